"""Envelopes: pack/unpack round trips, strict validation, compact route dtypes."""

from __future__ import annotations

import base64
import contextlib
import tracemalloc

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
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


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(["data", "shape", "dtype", "x"]),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**70), 2**70)
            | st.floats()
            | st.text(max_size=12),
            lambda inner: st.lists(inner, max_size=4),
            max_leaves=8,
        ),
    )
)
def test_fuzz_unpack_only_raises_r3data_errors(envelope):
    tracemalloc.start()
    try:
        with contextlib.suppress(R3DataError):
            unpack_ndarray(envelope)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


@SETTINGS
@given(st.binary(max_size=64), st.integers(0, 48))
def test_fuzz_decode_base64(data, expected):
    try:
        decoded = decode_base64(data, expected_nbytes=expected)
    except R3DataError:
        return
    assert len(decoded) == expected
    assert base64.b64decode(data, validate=True) == decoded


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
