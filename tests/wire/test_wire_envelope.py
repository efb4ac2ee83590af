"""Envelopes: pack/unpack round trips, strict validation, compact route dtypes."""

from __future__ import annotations

import base64
import math
import re
import tracemalloc

import numpy as np
import orjson
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from r3data.errors import R3DataError, WireFormatError
from r3data.wire import ALL_DTYPES, compact_routes, decode_base64, pack_ndarray, unpack_ndarray

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(
    hnp.arrays(
        dtype=st.sampled_from(sorted(ALL_DTYPES)).map(np.dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    ),
    st.sampled_from(["str", "bytes", "bytearray", "memoryview", "json"]),
)
def test_round_trip_every_dtype_and_data_form(array, form):
    envelope = pack_ndarray(array, start=3, note="x")
    assert list(envelope) == ["data", "shape", "dtype", "start", "note"]
    data = envelope["data"]
    if form == "json":
        envelope = orjson.loads(orjson.dumps(envelope))
    elif form != "str":
        envelope["data"] = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}[form](
            data.encode()
        )
    decoded, sidecar = unpack_ndarray(envelope)
    assert sidecar == {"start": 3, "note": "x"}
    assert decoded.dtype == array.dtype.newbyteorder("=")
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)
    assert decoded.flags.writeable


def test_data_is_standard_padded_base64_of_little_endian_bytes():
    array = np.array([[1, 256], [65535, 7]], dtype=np.uint16)
    envelope = pack_ndarray(array)
    assert base64.b64decode(envelope["data"]) == array.astype("<u2").tobytes()
    big = array.astype(">u2")
    assert pack_ndarray(big)["data"] == envelope["data"]


def test_non_contiguous_input_packs_in_c_order():
    array = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2].T
    decoded, _ = unpack_ndarray(pack_ndarray(array))
    np.testing.assert_array_equal(decoded, array)


def test_torch_tensors_are_moved_to_host():
    tensor = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    decoded, _ = unpack_ndarray(pack_ndarray(tensor))
    np.testing.assert_array_equal(decoded, tensor.numpy())
    grad = torch.ones(3, requires_grad=True)
    np.testing.assert_array_equal(unpack_ndarray(pack_ndarray(grad))[0], np.ones(3, np.float32))
    with pytest.raises(WireFormatError, match="bfloat16"):
        pack_ndarray(torch.zeros(2, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("value", "sidecar", "match"),
    [
        ([[1, 2], [3, 4]], {}, "found list"),
        (np.array([object(), 1], dtype=object), {}, "object"),
        (np.array(["ab"]), {}, "dtype"),
        (np.zeros(2, np.complex64), {}, "complex64"),
        (np.zeros(2), {"shape": [2]}, "collide"),
        (np.zeros(2), {"data": "x"}, "collide"),
    ],
)
def test_pack_rejects(value, sidecar, match):
    with pytest.raises(WireFormatError, match=match):
        pack_ndarray(value, **sidecar)


def test_pack_allowed_dtypes():
    with pytest.raises(WireFormatError, match="float64"):
        pack_ndarray(np.zeros(2), allowed_dtypes=("uint8",))


def _envelope(**overrides):
    envelope = pack_ndarray(np.arange(6, dtype=np.uint16).reshape(2, 3))
    envelope.update(overrides)
    return envelope


@pytest.mark.parametrize(
    ("envelope", "match"),
    [
        ([1, 2], "expected an object"),
        ({"data": "AAAA", "shape": [3]}, r"missing \['dtype'\]"),
        (_envelope(dtype="object"), "dtype"),
        (_envelope(dtype=">u2"), "big-endian"),
        (_envelope(dtype=5), "dtype"),
        (_envelope(shape=[2, True]), "non-negative ints, found True"),
        (_envelope(shape=[2, -3]), "found -3"),
        (_envelope(shape=[2, 3.0]), "found 3.0"),
        (_envelope(shape="2,3"), "list of ints"),
        (_envelope(shape=[1] * 33), "at most 32 dimensions"),
        (_envelope(shape=[3, 3]), "expected 18 bytes.*decodes to 12 bytes"),
        (_envelope(shape=[2**40, 2**40]), "decodes to 12 bytes"),
        (_envelope(data="", shape=[0, 2**62, 4]), "at most 9223372036854775807 bytes"),
        (_envelope(data="AAECAwQFBgcICQo"), "multiple of 4"),
        (_envelope(data="AAECAwQF!gcICQoL"), "invalid base64"),
        (_envelope(data="AAEC\nAwQFBgcICQoL"[:16]), "invalid base64"),
        (_envelope(data=12), "found int"),
        (_envelope(data=np.zeros((2, 3), np.uint8)), "uint16, found"),
    ],
)
def test_unpack_rejects(envelope, match):
    with pytest.raises(WireFormatError, match=match):
        unpack_ndarray(envelope)


def test_unpack_checks_ndim_and_allowed():
    with pytest.raises(WireFormatError, match="expected 3 dimensions, found 2"):
        unpack_ndarray(_envelope(), ndim=3)
    with pytest.raises(WireFormatError, match="uint8"):
        unpack_ndarray(_envelope(), allowed_dtypes=["uint8"])


def test_unpack_accepts_an_already_decoded_array():
    array = np.arange(6, dtype=np.uint16).reshape(2, 3)
    decoded, sidecar = unpack_ndarray(_envelope(data=array, start=4))
    assert decoded is array
    assert sidecar == {"start": 4}


def test_claimed_size_is_checked_before_any_allocation():
    envelope = _envelope(shape=[2**31, 2**31], dtype="float64")
    tracemalloc.start()
    try:
        with pytest.raises(WireFormatError):
            unpack_ndarray(envelope)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


_BASE64 = re.compile(rb"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
_FORMS = {
    "str": lambda raw: raw.decode("latin-1"),
    "bytes": bytes,
    "bytearray": bytearray,
    "memoryview": memoryview,
}


def _strict_base64(data: object) -> bytes | None:
    """What padded RFC 4648 base64 without line breaks decodes to; ``None`` for anything else."""
    if isinstance(data, str):
        data = data.encode() if data.isascii() else None
    if not isinstance(data, bytes | bytearray | memoryview):
        return None
    return base64.b64decode(data) if _BASE64.fullmatch(data) else None


@st.composite
def mutated_base64(draw) -> bytes:
    """Base64 of random bytes, often broken: a byte deleted, replaced or inserted, padding
    added or stripped, whitespace or a newline injected."""
    encoded = bytearray(base64.b64encode(draw(st.binary(max_size=48))))
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(encoded)))
        op = draw(st.sampled_from(["delete", "replace", "insert", "pad", "unpad", "space"]))
        if op == "delete":
            del encoded[at : at + 1]
        elif op == "replace" and at < len(encoded):
            encoded[at] = draw(st.integers(0, 255))
        elif op == "insert":
            encoded.insert(at, draw(st.sampled_from(b"A/+=-_!\xff")))
        elif op == "pad":
            encoded += b"=" * draw(st.integers(1, 2))
        elif op == "unpad":
            encoded = encoded.rstrip(b"=")
        elif op == "space":
            encoded[at:at] = draw(st.sampled_from([b" ", b"\n", b"\r\n", b"\t"]))
    return bytes(encoded)


@SETTINGS
@given(mutated_base64(), st.sampled_from(sorted(_FORMS)), st.none() | st.integers(-2, 2))
def test_fuzz_decode_base64(raw, form, delta):
    truth = _strict_base64(raw)
    size = len(raw) // 4 * 3 if truth is None else len(truth)
    expected = None if delta is None else max(0, size + delta)
    data = _FORMS[form](raw)
    valid = truth is not None and expected in (None, len(truth))
    event(f"valid={valid}")  # see --hypothesis-show-statistics
    if not valid:
        with pytest.raises(R3DataError):
            decode_base64(data, expected_nbytes=expected)
        return
    decoded = decode_base64(data, expected_nbytes=expected)
    assert isinstance(decoded, bytearray)
    assert decoded == truth


GOOD_DTYPES = [*sorted(ALL_DTYPES), "<u2", "|u1", "<i8", "<f4", "?"]
BAD_DTYPES = [
    "object", "O", ">u2", ">f8", "V8", "complex64", "S3", "U2", "M8[s]", "i1,i2", "(2,)i4",
    "bfloat16", "float128", "", "nope", 5, None, True, ["uint8"],
]  # fmt: skip
_HUGE = [2**31, 2**40, 2**62, 2**63, 2**64 + 1]


def _truth_or(truth, broken):
    """``(value, True)`` from ``truth`` three times in four, else ``(value, False)`` from
    ``broken`` (which may still happen to be valid)."""
    return st.sampled_from([True, True, True, False]).flatmap(
        lambda kept: truth.map(lambda v: (v, True)) if kept else broken.map(lambda v: (v, False))
    )


def _envelopes_of(array: np.ndarray):
    encoded = base64.b64encode(array.tobytes())
    as_bytes = np.frombuffer(array.tobytes(), np.uint8)
    entry = (
        st.integers(0, 6)
        | st.sampled_from(_HUGE)
        | st.integers(-3, -1)
        | st.booleans()
        | st.floats(0, 4)
    )
    return st.fixed_dictionaries(
        {
            "data": _truth_or(
                st.sampled_from(sorted(_FORMS)).map(lambda form: _FORMS[form](encoded))
                | st.just(array),
                mutated_base64().map(lambda raw: raw.decode("latin-1"))
                | st.sampled_from(["", "AAAA", "QUJDRA==", "A" * 400])
                | st.just(as_bytes)
                | st.integers()
                | st.none()
                | st.lists(st.integers(), max_size=3),
            ),
            "shape": _truth_or(
                st.just(list(array.shape)),
                st.lists(entry, max_size=5)
                | st.lists(st.integers(0, 6), max_size=3)
                | st.just([1] * (33 - array.ndim) + list(array.shape))
                | st.sampled_from(_HUGE).map(lambda n: [*array.shape, n, n])
                | st.just([{0: False, 1: True}.get(n, float(n)) for n in array.shape])
                | st.just(tuple(array.shape))
                | st.text(max_size=4)
                | st.integers()
                | st.none(),
            ),
            "dtype": _truth_or(
                st.just(array.dtype.name), st.sampled_from(GOOD_DTYPES + BAD_DTYPES)
            ),
        },
        optional={"start": st.tuples(st.integers(0, 9), st.just(True))},
    )


def _expected_array(envelope: dict) -> np.ndarray | None:
    """What ``envelope`` decodes to, worked out the slow way; ``None`` if it is invalid."""
    data, shape, name = envelope["data"], envelope["shape"], envelope["dtype"]
    if not isinstance(name, str) or name not in GOOD_DTYPES:
        return None
    if not isinstance(shape, list | tuple) or len(shape) > 32:
        return None
    if not all(type(n) is int and n >= 0 for n in shape):
        return None
    dtype = np.dtype(name)
    if isinstance(data, np.ndarray):
        return data if data.dtype == dtype and data.shape == tuple(shape) else None
    decoded = _strict_base64(data)
    if decoded is None or len(decoded) != math.prod(shape) * dtype.itemsize:
        return None
    try:  # numpy cannot shape some empty arrays (huge extents beside a zero)
        return np.frombuffer(decoded, dtype).reshape(shape)
    except ValueError:
        return None


@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from(sorted(ALL_DTYPES)).map(np.dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ).flatmap(lambda array: st.tuples(st.just(array), _envelopes_of(array)))
)
def test_fuzz_unpack_round_trips_or_raises_r3data_errors(case):
    array, drawn = case
    envelope = {key: value for key, (value, _) in drawn.items()}
    truthful = all(flag for _, flag in drawn.values())
    expected = _expected_array(envelope)
    event(f"valid={expected is not None}, truthful={truthful}")
    data = envelope["data"]
    budget = 2 * len(data) if isinstance(data, str | bytes | bytearray | memoryview) else 0
    tracemalloc.start()
    try:
        if expected is None:
            with pytest.raises(R3DataError):
                unpack_ndarray(envelope)
        else:
            decoded, sidecar = unpack_ndarray(envelope)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < budget + 64 * 1024
    if expected is None:
        assert not truthful, "the oracle rejected a truthful envelope"
        return
    assert sidecar == {key: envelope[key] for key in envelope.keys() - {"data", "shape", "dtype"}}
    assert decoded.dtype == expected.dtype
    assert decoded.shape == expected.shape
    assert decoded.tobytes() == expected.tobytes()
    if truthful:
        np.testing.assert_array_equal(decoded, array)
        assert decoded.tobytes() == array.tobytes()


@pytest.mark.parametrize(
    ("high", "dtype"),
    [(0, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.int32)],
)
def test_compact_routes_picks_the_smallest_dtype(high, dtype):
    routes = np.zeros((3, 2, 2), dtype=np.int64)
    routes[1, 1, 1] = high
    compact = compact_routes(routes)
    assert compact.dtype == dtype
    np.testing.assert_array_equal(compact, routes)


def test_compact_routes_keeps_compact_input_and_torch():
    routes = np.ones((2, 2, 2), np.uint8)
    assert compact_routes(routes) is routes
    assert compact_routes(torch.full((1, 2, 2), 300)).dtype == np.uint16
    assert compact_routes(np.zeros((0, 4, 8), np.int64)).dtype == np.uint8


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (np.zeros((2, 3), np.int32), r"found shape \(2, 3\)"),
        (np.zeros((1, 1, 1), np.float32), "integer ids"),
        (np.array([[[0, -2]]], np.int32), "found -2 at row 0, layer 0, slot 1"),
        (np.array([[[2**40]]], np.int64), "<= 2147483647"),
        ([[[1]]], "found list"),
    ],
)
def test_compact_routes_rejects(routes, match):
    with pytest.raises(WireFormatError, match=match):
        compact_routes(routes)
