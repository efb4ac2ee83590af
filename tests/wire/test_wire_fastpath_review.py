"""An adversarial review of the wire's fast paths: each one against a plain, obviously correct
reference (a whole pybase64 decode sliced, a JSON parse plus strict base64, ``np.load``), on
valid input and on input with one thing wrong, through every path the fast ones branch to."""

from __future__ import annotations

import array
import io
import json
import struct

import numpy as np
import orjson
import pybase64
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, R3DataError, SegmentError, WireFormatError
from r3data.validate import checked_int, nonnegative_int
from r3data.wire import blob, load_packed_body, read_npy
from r3data.wire.blob import Blob, decode_base64, decode_base64_into
from r3data.wire.envelope import unpack_ndarray
from r3data.wire.producers.primerl import kept_tokens_rows, primerl_routes
from r3data.wire.producers.sglang import SglangOptions, flat_int32_rows
from r3data.wire.producers.vllm import npy_routes
from r3data.wire.rows import EncodedRows, InlineRows

FIELDS = ("routed_experts", "sampling_mask")
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# A blob longer than three direct chunks (each ``_CHUNK_GROUPS`` groups), encoded once.
_BIG = np.random.default_rng(11).integers(0, 256, 3 * (1 << 20) + 2, dtype=np.uint8).tobytes()
_BIG_B64 = pybase64.b64encode(_BIG)
_EDGES = sorted(
    {
        0,
        1,
        2,
        3,
        blob._SMALL_RANGE - 1,
        blob._SMALL_RANGE,
        blob._SMALL_RANGE + 1,
        3 * blob._CHUNK_GROUPS - 1,
        3 * blob._CHUNK_GROUPS,
        3 * blob._CHUNK_GROUPS + 1,
        6 * blob._CHUNK_GROUPS + 2,
        len(_BIG) - 3,
        len(_BIG) - 2,
        len(_BIG) - 1,
        len(_BIG),
    }
)
_BAD_BYTES = [ord(c) for c in '!="\\ \n\t-_.:'] + [0x00, 0x7F, 0x80, 0xC3, 0xFF]


@pytest.fixture(params=["shipped", "bounce"])
def path(request, monkeypatch):
    """``shipped``: libbase64 for long ranges, one pybase64 bounce for short ones;
    ``bounce``: pybase64 only (a build without the direct decoder)."""
    if request.param == "bounce":
        monkeypatch.setattr(blob, "direct_decoder", lambda: None)
    elif blob.direct_decoder() is None:
        pytest.skip("this pybase64 build exports no base64_decode")
    return request.param


def _range(data: st.DataObject, size: int) -> tuple[int, int]:
    """A (skip, nbytes) range of a ``size``-byte blob, often starting or ending at an edge."""
    edge = st.sampled_from([e for e in _EDGES if e <= size])
    skip = data.draw(edge | st.integers(0, size), label="skip")
    end = data.draw(
        st.sampled_from([e for e in _EDGES if skip <= e <= size]) | st.integers(skip, size),
        label="end",
    )
    return skip, end - skip


# --- decode_base64_into: ranges, forms, corruption -----------------------------------------


@SETTINGS
@given(st.data(), st.sampled_from(["bytes", "bytearray", "memoryview", "str"]))
def test_ranges_across_chunks_and_thresholds_equal_a_sliced_decode(path, data, form):
    skip, nbytes = _range(data, len(_BIG))
    source = {
        "bytes": _BIG_B64,
        "bytearray": bytearray(_BIG_B64),
        "memoryview": memoryview(_BIG_B64),
        "str": _BIG_B64.decode(),
    }[form]
    dtype = data.draw(st.sampled_from(["u1", "<u2", "<i4", "<f8"]))
    itemsize = np.dtype(dtype).itemsize
    nbytes -= nbytes % itemsize
    out = np.full(nbytes // itemsize, 7, dtype)
    seen: list[int] = []
    decode_base64_into(source, out, skip=skip, on_bytes=seen.append)
    assert out.tobytes() == _BIG[skip : skip + nbytes]
    assert seen == sorted(seen)
    assert not nbytes or seen[-1] == nbytes


def _groups(skip: int, nbytes: int) -> range:
    """The base64 groups whose decoded bytes a range touches."""
    return range(skip // 3, -(-(skip + nbytes) // 3)) if nbytes else range(0)


@SETTINGS
@given(st.data(), st.sampled_from(_BAD_BYTES), st.sampled_from(["bytes", "str"]))
def test_one_bad_character_in_the_range_is_refused_naming_its_characters(path, data, bad, form):
    """A bad character in any group the range touches (the cut first or last group, a chunk
    boundary, the padded group) is a WireFormatError whose character range holds it; unless
    the change is valid base64 after all (``=`` ending the blob), then the result is the
    reference's."""
    raw = data.draw(st.sampled_from([_BIG[:-2], _BIG[:-1], _BIG]), label="blob")
    encoded = bytearray(pybase64.b64encode(raw))
    skip, nbytes = _range(data, len(raw))
    assume(nbytes)
    groups = _groups(skip, nbytes)
    at = data.draw(
        st.sampled_from([4 * groups[0], 4 * groups[-1] + 3, len(encoded) - 1, len(encoded) - 2])
        | st.integers(4 * groups[0], 4 * groups[-1] + 3),
        label="at",
    )
    assume(4 * groups[0] <= at <= 4 * groups[-1] + 3)
    encoded[at] = bad
    if form == "str":
        assume(bad < 0x80)
    source = encoded.decode("ascii") if form == "str" else bytes(encoded)
    try:
        reference = pybase64.b64decode(bytes(encoded), validate=True)
    except ValueError:
        reference = None
    out = np.zeros(nbytes, np.uint8)
    if reference is not None:  # "=" now ends the blob: a shorter, valid one
        if skip + nbytes <= len(reference):
            decode_base64_into(source, out, skip=skip)
            assert out.tobytes() == reference[skip : skip + nbytes]
        else:
            with pytest.raises(WireFormatError, match="inside the"):
                decode_base64_into(source, out, skip=skip)
        return
    with pytest.raises(WireFormatError, match=r"invalid base64 in characters \[") as info:
        decode_base64_into(source, out, skip=skip)
    low, high = map(int, str(info.value).split("characters [")[1].split(")")[0].split(", "))
    assert low <= at < high


@pytest.mark.parametrize("tail", [b"QQ==", b"QUI="])
@pytest.mark.parametrize("groups_after", [1, 5, blob._CHUNK_GROUPS + 3])
def test_padding_before_the_end_of_a_long_blob_is_refused(path, tail, groups_after):
    """A padded group with more groups after it, at the start of a direct chunk, inside one
    and at its end: refused (libbase64 stops at the padding: the bytes after it never slide
    in), never decoded short."""
    head = pybase64.b64encode(_BIG[: 3 * (blob._CHUNK_GROUPS - 1)])
    encoded = head + tail + b"QkNE" * groups_after
    nbytes = len(head) // 4 * 3 + 3 * groups_after
    for skip in (0, len(head) // 4 * 3 - 3, len(head) // 4 * 3):
        with pytest.raises(WireFormatError, match="invalid base64 in characters"):
            decode_base64_into(encoded, np.empty(nbytes - skip, np.uint8), skip=skip)


def test_a_destination_that_is_not_writable_and_c_contiguous_is_refused_untouched(path):
    """Bytes decode into ``dest``'s own memory only: a read-only array (over an immutable
    ``bytes``), a reversed view and a strided one are refused before a byte is written
    (the direct decoder would write through the pointer past the view's elements)."""
    encoded = pybase64.b64encode(_BIG[:60000])
    immutable = bytes(30000)
    base = np.zeros(90000, np.uint8)
    wide = np.zeros((30000, 2), np.int32)
    for dest in (
        np.frombuffer(immutable, np.uint8),
        base[:30000][::-1],
        base[::3],
        wide[:, 0],
        np.zeros((300, 200), np.uint8).T,
    ):
        with pytest.raises(SegmentError, match="expected a writable C-contiguous destination"):
            decode_base64_into(encoded, dest)
    assert immutable == bytes(30000)
    assert not base.any()
    assert not wide.any()


def test_every_buffer_kind_decodes_and_odd_ones_are_refused_typed(path):
    raw = _BIG[: 3 * blob._CHUNK_GROUPS + 100]
    encoded = pybase64.b64encode(raw)
    for source in (
        encoded,
        bytearray(encoded),
        memoryview(encoded),
        memoryview(array.array("i", encoded)),  # a non-byte format: its bytes
        memoryview(np.frombuffer(encoded, np.uint8).reshape(4, -1)),
    ):
        out = np.empty(len(raw) - 5, np.uint8)
        decode_base64_into(source, out, skip=5)
        assert out.tobytes() == raw[5:]
    for source, match in (
        (memoryview(encoded + encoded)[::2], "not contiguous"),
        ([65, 65, 65, 65], "found list"),
        (12, "found int"),
    ):
        with pytest.raises(WireFormatError, match=match):
            decode_base64_into(source, np.empty(1, np.uint8))
        with pytest.raises(WireFormatError, match=match):
            decode_base64(source)


# --- load_packed_body: escapes, odd keys, decode=False as decode=True ----------------------


@pytest.mark.parametrize(
    "raw",
    [
        # an escaped quote ends the scan's blob early: the rest of the string would be parsed
        # as JSON (keys taken from inside a string value)
        b'{"choices":[{"routed_experts":"AAA\\", "token_ids": [1,2], "x":"y"}]}',
        b'{"routed_experts": {"data": "AAA\\", "shape": [3], "dtype": "uint8", "x": "y"}}',
        # an escaped backslash: the blob's characters hold one
        b'{"routed_experts":"AA\\\\"}',
    ],
)
@pytest.mark.parametrize("decode", [True, False])
def test_a_blob_ending_in_an_escape_is_refused_while_splicing(raw, decode):
    with pytest.raises(WireFormatError, match="escape"):
        load_packed_body(raw, FIELDS, decode=decode)


@pytest.mark.parametrize("decode", [True, False])
def test_a_registered_key_right_under_an_escaped_one_is_decoded(decode):
    """The value of ``routed\\u005fexperts`` is left as parsed; a registered key directly in
    it is decoded like one deeper down (it was refused as a lost blob)."""
    raw = b'{"routed\\u005fexperts": {"routed_experts": "QUJD", "n": 1}}'
    inner = load_packed_body(raw, FIELDS, decode=decode)["routed_experts"]
    assert inner["n"] == 1
    assert bytes(_decoded(inner["routed_experts"])) == b"ABC"


_TEXT = st.lists(
    st.sampled_from([*'ab"\\/{},:[] =\n', '"routed_experts": "QUJD"', "ü", "✓"]), max_size=6
).map("".join)
_PLAIN_KEYS = st.sampled_from(["a", "text", "data", "shape", "ids", "my_routed_experts", "x"])
_WIRE_DTYPES = st.sampled_from(["uint8", "<u2", "int32", "int64", "float32", "bool"])


class _Key(str):
    """A registered key the body writes with a JSON escape (the byte scan does not see it)."""


def _envelopes():
    @st.composite
    def envelope(draw):
        dtype = np.dtype(draw(_WIRE_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        data = draw(
            st.binary(
                min_size=int(np.prod(shape)) * dtype.itemsize,
                max_size=int(np.prod(shape)) * dtype.itemsize,
            )
        )
        sidecar = draw(
            st.dictionaries(
                st.sampled_from(["start", "routed_experts", "note"]),
                st.integers(0, 9) | _TEXT,
                max_size=2,
            )
        )
        encoded = pybase64.b64encode(data).decode()
        return {"data": encoded, "shape": shape, "dtype": dtype.str, **sidecar}

    return envelope()  # fmt: skip


_ENVELOPE = _envelopes()
_REGISTERED_VALUE = st.one_of(
    st.none(),
    st.binary(max_size=40).map(lambda b: pybase64.b64encode(b).decode()),
    _ENVELOPE,
    st.fixed_dictionaries({"ids": st.none() | _ENVELOPE, "counts": st.none() | _ENVELOPE}),
)


def _trees():
    leaves = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _TEXT

    def extend(children):
        entry = st.one_of(
            st.tuples(_PLAIN_KEYS, children),
            st.tuples(st.sampled_from(FIELDS), _REGISTERED_VALUE),
            st.tuples(st.sampled_from(FIELDS).map(_Key), children),
            st.tuples(  # an escaped registered key right over a plain one
                st.sampled_from(FIELDS).map(_Key),
                st.dictionaries(st.sampled_from(FIELDS), _REGISTERED_VALUE, min_size=1),
            ),
        )
        return st.lists(children, max_size=4) | st.lists(
            entry, max_size=4, unique_by=lambda kv: str(kv[0])
        ).map(lambda kvs: dict(kvs))

    return st.recursive(leaves, extend, max_leaves=12)


def _dump(node: object, spaced: bool, ascii_only: bool) -> bytes:
    """JSON of ``node``, :class:`_Key` keys written with ``\\u005f`` for their underscore."""
    colon, comma = (b" : ", b" ,\n ") if spaced else (b":", b",")
    if isinstance(node, dict):
        items = []
        for key, value in node.items():
            name = json.dumps(str(key)).encode()
            if isinstance(key, _Key):
                name = name.replace(b"_", b"\\u005f", 1)
            items.append(name + colon + _dump(value, spaced, ascii_only))
        return b"{" + comma.join(items) + b"}"
    if isinstance(node, list):
        return b"[" + comma.join(_dump(v, spaced, ascii_only) for v in node) + b"]"
    return json.dumps(node, ensure_ascii=ascii_only).encode()


def _meant(node: object) -> object:
    """What a body means: every registered key written plainly has its value decoded (a bare
    blob to bytes, an envelope's data to its array, a group's members), nothing inside it
    looked at; an escaped one's value is walked like any other."""
    if isinstance(node, list):
        return [_meant(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in FIELDS and not isinstance(key, _Key):
            out[str(key)] = _registered(value)
        else:
            out[str(key)] = _meant(value)
    return out


def _registered(value: object) -> object:
    if value is None:
        return None
    if isinstance(value, str):
        return ("bytes", pybase64.b64decode(value, validate=True))
    if "data" in value:
        array = np.frombuffer(pybase64.b64decode(value["data"]), value["dtype"])
        return {**value, "data": _comparable(array.reshape(value["shape"]))}
    return {k: _registered(v) for k, v in value.items()}


def _comparable(value: object) -> object:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, bytes | bytearray):
        return ("bytes", bytes(value))
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # the recursive strategy
@given(
    _trees(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["bytes", "bytearray", "memoryview"]),
)
def test_bodies_with_keys_in_odd_places_mean_what_json_says(tree, spaced, ascii_only, form):
    """Registered keys at any depth, in lists, under escaped keys, inside sidecars and strings,
    dumped compact or spaced: decode=True gives what JSON plus strict base64 means, and
    decode=False gives the same once its blobs are decoded."""
    raw = _dump(tree, spaced, ascii_only)
    assert _comparable(orjson.loads(raw)) == _comparable(_meant_plain(tree))  # the dump is JSON
    body = {"bytes": raw, "bytearray": bytearray(raw), "memoryview": memoryview(raw)}[form]
    expected = _comparable(_meant(tree))
    assert _comparable(load_packed_body(body, FIELDS)) == expected
    assert _comparable(_decoded(load_packed_body(body, FIELDS, decode=False))) == expected


_MUTATIONS = [*b'{}[]":, \\/=+AQx0-', 0x80, 0xFF]


def _mutated(rng: np.random.Generator, raw: bytes) -> bytes:
    body = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(0, len(body) + 1))
        kind = rng.random()
        if kind < 0.4 and at < len(body):
            body[at] = int(rng.choice(_MUTATIONS))
        elif kind < 0.7:
            del body[at : at + int(rng.integers(1, 6))]
        else:
            body.insert(at, int(rng.choice(_MUTATIONS)))
    return bytes(body)


def test_decode_false_defers_only_the_blobs_characters():
    """Seeded mutations of valid bodies: decode=False succeeds wherever decode=True does, with
    the same arrays once decoded; where only decode=False succeeds, decoding one of its blobs
    is what fails. Nothing but R3DataError escapes either."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 200, (3, 2, 2)).astype(np.uint8)
    seeds = [
        orjson.dumps(TREE)
        for TREE in (
            {"choices": [{"routed_experts": pybase64.b64encode(rows).decode(), "i": 1}]},
            {"choices": [{"routed_experts": {**_envelope_of(rows), "start": 2}}]},
            {"sampling_mask": {"ids": _envelope_of(rows[0]), "counts": None}, "t": "a\\b"},
        )
    ]
    outcomes = {"both": 0, "deferred": 0, "refused": 0}
    for _ in range(1500):
        raw = _mutated(rng, seeds[int(rng.integers(0, len(seeds)))])
        try:
            eager = _comparable(load_packed_body(raw, FIELDS))
        except R3DataError:
            eager = None
        try:
            lazy = load_packed_body(raw, FIELDS, decode=False)
        except R3DataError:
            assert eager is None, raw
            outcomes["refused"] += 1
            continue
        if eager is not None:
            assert _comparable(_decoded(lazy)) == eager, raw
            outcomes["both"] += 1
        else:
            with pytest.raises(WireFormatError, match="base64"):
                _decoded(lazy)
            outcomes["deferred"] += 1
    assert min(outcomes.values()) > 20, outcomes


def _envelope_of(array: np.ndarray) -> dict[str, object]:
    return {"data": pybase64.b64encode(array).decode(), "shape": list(array.shape),
            "dtype": array.dtype.str}  # fmt: skip


def _meant_plain(node: object) -> object:
    """``node`` as plain JSON values (the keys as strings)."""
    if isinstance(node, dict):
        return {str(k): _meant_plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_meant_plain(v) for v in node]
    return node


# --- .npy headers --------------------------------------------------------------------------


def _npy_file(header: bytes, data: bytes = bytes(64)) -> bytes:
    header = header + b" " * (118 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


@SETTINGS
@given(
    st.integers(0, 400),
    st.sampled_from([(4, 2), (48, 8), (3, 1)]),
    st.sampled_from(["|u1", "<u2", "<i4", "<i8", "|i1", "<i2"]),
    st.sampled_from([(1, 0), (2, 0), (3, 0)]),
    st.sampled_from(["str", "blob", "decoded"]),
    st.data(),
)
def test_npy_rows_clipped_and_decoded_in_place_equal_np_load(
    rows, row_shape, dtype, version, form, data
):
    """Every ``.npy`` version numpy writes, as a str, a spliced Blob or decoded bytes: rows
    clipped to any span and decoded into place (a skip that is no multiple of 3, ranges on
    both sides of the short-range threshold) are np.load's rows."""
    routes = np.random.default_rng(rows).integers(0, 120, (rows, *row_shape)).astype(dtype)
    with io.BytesIO() as buffer:
        np.lib.format.write_array(buffer, routes, version=version)
        raw = buffer.getvalue()
    encoded = pybase64.b64encode(raw)
    value = {
        "str": encoded.decode(),
        "blob": Blob(memoryview(encoded), "blob"),
        "decoded": bytearray(raw),
    }[form]
    found = npy_routes("routed_experts", value, pos=5, meta=None, what="npy")
    np.testing.assert_array_equal(np.load(io.BytesIO(raw)), routes)
    lo = data.draw(st.integers(5, 5 + rows), label="lo")
    hi = data.draw(st.integers(lo, 5 + rows), label="hi")
    part = found.clipped(lo, hi)
    assert (part.pos, part.rows, part.row_shape) == (lo, hi - lo, row_shape)
    np.testing.assert_array_equal(part.array, routes[lo - 5 : hi - 5])
    if isinstance(part, EncodedRows):
        dest = np.full((hi - lo, *row_shape), 99, routes.dtype)
        part.decode_into(dest)
        np.testing.assert_array_equal(dest, routes[lo - 5 : hi - 5])


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (b"\x93NUMPY\x02\x00\x10\x00", "version 2.0 of at least 12 bytes, found 10"),
        (b"\x93NUMPY\x04\x00\x10\x00\x00\x00", "version 1, 2 or 3, found 4.0"),
        (b"\x93NUMPY\x01\x00\x11\x27", "at most 10000 bytes, found 10001"),
        (b"\x93NUMPY\x01\x00\x00\x00", "header is as np.save writes it"),
        (b"\x93NUMPY\x01\x00\xff\x00", "header of 265 bytes, found 10"),
        (b"\x93NUMPZ\x01\x00\xff\x00", "starting with"),
        (b"\x93NUMPY\x01", "starting with"),
    ],
)
def test_npy_prefixes_that_lie_are_wire_format_errors(prefix, match):
    with pytest.raises(WireFormatError, match=match):
        read_npy(prefix)
    with pytest.raises(WireFormatError, match=match):
        npy_routes("r", pybase64.b64encode(prefix).decode(), pos=0, meta=None, what="npy")


def test_decoded_rows_in_a_memoryview_of_another_format_are_read_by_their_bytes():
    """A decoded blob handed over as a memoryview of int32 (4 bytes an item): sized by its
    bytes, not its items (it was refused, the header's size checked against a quarter)."""
    routes = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    with io.BytesIO() as buffer:
        np.save(buffer, routes)
        raw = buffer.getvalue()
    assert len(raw) % 4 == 0
    view = memoryview(np.frombuffer(raw, np.int32))
    np.testing.assert_array_equal(read_npy(view), routes)
    envelope = {"data": memoryview(np.frombuffer(routes.tobytes(), np.int32)), "shape": [2, 3, 4]}
    response = {"choices": [{"routed_experts": envelope, "token_ids": [0]}]}
    (found,) = primerl_routes(response, prompt_len=2, completion_len=1)
    np.testing.assert_array_equal(found.array, routes)


@pytest.mark.parametrize("descr", [b"\xff", b"\xc3(", b"u\x80"])
@pytest.mark.parametrize("encoded", [False, True])
def test_a_non_utf8_npy_descr_is_a_wire_format_error(descr, encoded):
    raw = _npy_file(b"{'descr': '" + descr + b"', 'fortran_order': False, 'shape': (2, 4, 8), }")
    value = pybase64.b64encode(raw).decode() if encoded else raw
    with pytest.raises(WireFormatError, match="dtype"):
        npy_routes("routed_experts", value, pos=0, meta=None, what="npy")


@pytest.mark.parametrize("encoded", [False, True])
def test_a_npy_descr_no_route_dtype_is_named_with_its_field(encoded):
    """A float ``.npy`` blob is refused naming the field it came in (the message named only
    the dtypes)."""
    raw = _npy_file(b"{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2, 2), }")
    value = pybase64.b64encode(raw).decode() if encoded else raw
    with pytest.raises(WireFormatError, match=r"^vllm choices\[0\]: .npy header descr: .*float64"):
        npy_routes("routed_experts", value, pos=0, meta=None, what="vllm choices[0]")


# --- helpers -------------------------------------------------------------------------------


def _decoded(value: object) -> object:
    """A spliced value with every Blob decoded (what decode=True gives): an envelope's into
    its array, a bare one into bytes."""
    if isinstance(value, Blob):
        return decode_base64(value.chars)
    if isinstance(value, dict) and isinstance(value.get("data"), Blob):
        return {**value, "data": unpack_ndarray(value)[0]}
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


# --- rows and integer checks ---------------------------------------------------------------


@pytest.mark.parametrize("span", [(8, 12), (9, 12), (10, 15), (15, 16), (12, 11)])
def test_clipping_outside_the_span_is_refused_not_wrapped(span):
    """Rows at positions [10, 14): a clip reaching before 10 would slice from the array's end
    (a negative index), one past 14 come up short; both are refused, encoded or inline."""
    routes = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)
    inline = InlineRows("routed_experts", routes, 10)
    encoded = EncodedRows(
        "routed_experts", pybase64.b64encode(routes).decode(), dtype=np.uint8,
        row_shape=(2, 2), rows=4, pos=10,
    )  # fmt: skip
    for rows in (inline, encoded):
        with pytest.raises(SegmentError, match=r"expected positions inside \[10, 14\)"):
            rows.clipped(*span)
        np.testing.assert_array_equal(rows.clipped(11, 13).array, routes[1:3])
        assert rows.clipped(12, 12).rows == 0


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (0, True), (2**80, True), (np.int64(7), True), (np.uint64(2**64 - 1), True),
        (np.int8(3), True), (True, False), (np.True_, False), (-1, False), (np.int64(-1), False),
        (3.0, False), (np.float64(3), False), ("3", False), (None, False), (np.array(3), False),
    ],
)  # fmt: skip
def test_checked_int_fast_and_slow_paths_agree(value, ok):
    """Plain ints take the fast path, numpy ints the slow one: both give a plain int or a
    typed error naming the value; bools and floats that hold integers are refused."""
    if ok:
        got = checked_int("n", value)
        assert type(got) is int
        assert got == int(value)
        assert nonnegative_int("n", value, WireFormatError) == got
    else:
        with pytest.raises(ConfigError, match=r"n: expected an int >= 0, found"):
            checked_int("n", value)
        with pytest.raises(WireFormatError, match=r"n: expected an int >= 0"):
            nonnegative_int("n", value, WireFormatError)
    with pytest.raises(ConfigError, match=r"expected an int in \[1, 5\], found 6"):
        checked_int("n", 6, minimum=1, maximum=5)
    with pytest.raises(ConfigError, match=r"expected an int in \[1, 5\], found np.int64\(0\)"):
        checked_int("n", np.int64(0), minimum=1, maximum=5)


def test_decoded_bytes_in_a_memoryview_that_is_not_contiguous_are_refused_typed():
    """Every producer's decoded-blob path (vLLM's ``.npy``, SGLang's flat int32, prime-rl's
    kept-token sets) refuses a strided memoryview with a WireFormatError, not numpy's or
    memoryview's TypeError."""
    with io.BytesIO() as buffer:
        np.save(buffer, np.zeros((2, 3, 4), np.uint8))
        raw = buffer.getvalue()
    strided = memoryview(np.frombuffer(raw + raw, np.uint8))[::2]
    with pytest.raises(WireFormatError, match="npy: buffer is not contiguous"):
        npy_routes("routed_experts", strided, pos=0, meta=None, what="npy")
    ids = memoryview(np.arange(48, dtype="<i4"))[::2]
    options = SglangOptions(num_layers=2, topk=3)
    with pytest.raises(WireFormatError, match="sglang: buffer is not contiguous"):
        flat_int32_rows(ids, options, 0, {}, "sglang")
    counts = memoryview(np.ones(4, "<i4"))
    with pytest.raises(WireFormatError, match=r"mask\.ids: buffer is not contiguous"):
        kept_tokens_rows({"ids": ids, "counts": counts}, 0, 4, {}, "mask")
    # contiguous views of the same values are read by their bytes
    (rows,) = [flat_int32_rows(memoryview(np.arange(24, dtype="<i4")), options, 0, {}, "ok")]
    np.testing.assert_array_equal(rows.array.reshape(-1), np.arange(24))
