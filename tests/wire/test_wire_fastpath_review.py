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

from r3data.errors import R3DataError, SegmentError, WireFormatError
from r3data.wire import blob, load_packed_body, read_npy
from r3data.wire.blob import Blob, decode_base64, decode_base64_into
from r3data.wire.producers.vllm import npy_routes
from r3data.wire.rows import EncodedRows

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
        monkeypatch.setattr(blob, "_direct_decoder", lambda: None)
    elif blob._direct_decoder() is None:
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
    assert seen == sorted(seen) and (not nbytes or seen[-1] == nbytes)


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
    assert not base.any() and not wide.any()


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


# --- .npy headers --------------------------------------------------------------------------


def _npy_file(header: bytes, data: bytes = bytes(64)) -> bytes:
    header = header + b" " * (118 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


@pytest.mark.parametrize("descr", [b"\xff", b"\xc3(", b"u\x80"])
@pytest.mark.parametrize("encoded", [False, True])
def test_a_non_utf8_npy_descr_is_a_wire_format_error(descr, encoded):
    raw = _npy_file(b"{'descr': '" + descr + b"', 'fortran_order': False, 'shape': (2, 4, 8), }")
    value = pybase64.b64encode(raw).decode() if encoded else raw
    with pytest.raises(WireFormatError, match="dtype"):
        npy_routes("routed_experts", value, pos=0, meta=None, what="npy")


# --- helpers -------------------------------------------------------------------------------


def _decoded(value: object) -> object:
    """A spliced value with every Blob decoded (what decode=True gives)."""
    if isinstance(value, Blob):
        return decode_base64(value.chars)
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value
