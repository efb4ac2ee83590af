"""Fuzzing load_packed_body: random and mutated bodies only ever raise R3DataError subclasses,
finish promptly, and allocate no more than a plain parse plus twice the body."""

from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3data.errors import R3DataError
from r3data.wire import ROUTE_DTYPES, load_packed_body, pack_csr, pack_ndarray

FIELDS = ("routed_experts", "sampling_mask")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.timeout(120)

TOKENS = [
    b"{", b"}", b"[", b"]", b'"', b":", b",", b" ", b"\\", b'\\"', b"null", b"1", b"-3",
    b"99999999999999999999", b'"routed_experts"', b'"sampling_mask"', b'"data"', b'"shape"',
    b'"dtype"', b'"uint8"', b'"int32"', b'"ids"', b'"counts"', b"QUJD", b"AAAA", b"==", b"[3]",
]  # fmt: skip


def _peak(call, expected: type[Exception]) -> int:
    """Peak traced memory of ``call``; only ``expected`` may escape it (anything else fails)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(expected):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _check(raw: bytes) -> None:
    """Only R3DataError may escape; memory stays within a plain parse plus twice the body."""
    baseline = _peak(lambda: orjson.loads(raw), orjson.JSONDecodeError)
    peak = _peak(lambda: load_packed_body(raw, FIELDS), R3DataError)
    assert peak <= baseline + 2 * len(raw) + 64 * 1024


@st.composite
def valid_bodies_and_choices(draw) -> tuple[bytes, list[tuple[str, object]]]:
    """A body of 1-3 choices, and per choice its kind and what it was built from."""
    choices, built = [], []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(0, 4))
        dtype = draw(st.sampled_from(ROUTE_DTYPES))
        routes = np.arange(rows * 6, dtype=dtype).reshape(rows, 3, 2)
        kind = draw(st.sampled_from(["envelope", "bare", "null", "mask"]))
        if kind == "envelope":
            choices.append({"routed_experts": pack_ndarray(routes, start=rows), "text": "hi"})
            built.append((kind, routes))
        elif kind == "bare":
            choices.append({"routed_experts": pack_ndarray(routes)["data"]})
            built.append((kind, routes))
        elif kind == "null":
            choices.append({"routed_experts": None})
            built.append((kind, None))
        else:
            counts = draw(st.lists(st.integers(0, 3), max_size=4))
            ids = np.arange(sum(counts), dtype=np.int32) * 7
            choices.append({"sampling_mask": pack_csr(ids, counts)})
            built.append((kind, (ids, np.array(counts, np.int32))))
    raw = orjson.dumps({"choices": choices, "note": '"routed_experts": "QUJD"'})
    return raw, built


valid_bodies = valid_bodies_and_choices().map(lambda pair: pair[0])


@st.composite
def mutated_bodies(draw) -> bytes:
    raw = bytearray(draw(valid_bodies))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "duplicate", "truncate"]))
        span = draw(st.integers(1, 12))
        if op == "delete":
            del raw[at : at + span]
        elif op == "insert":
            raw[at:at] = draw(st.sampled_from(TOKENS))
        elif op == "replace" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif op == "duplicate":
            raw[at:at] = raw[at : at + span]
        else:
            del raw[at:]
    return bytes(raw)


@st.composite
def lying_envelopes(draw) -> bytes:
    """Valid JSON whose envelopes claim shapes and dtypes their blobs do not hold."""
    shape = draw(st.lists(st.integers(-2, 2**62) | st.booleans() | st.floats(), max_size=5))
    dtype = draw(st.sampled_from(["uint8", "int64", "float64", "object", ">u2", "V8", "bool"]))
    data = draw(st.sampled_from(["", "AAAA", "QUJDRA==", "A" * 400]))
    envelope = {"data": data, "shape": shape, "dtype": dtype}
    return orjson.dumps({"choices": [{"routed_experts": envelope}]})


@pytest.mark.parametrize(
    "raw",
    [
        # empty arrays whose other extents overflow what numpy can shape (found by fuzzing)
        b'{"choices":[{"routed_experts":{"data":"","shape":[0,12709424,90713906831],'
        b'"dtype":"int64"}}]}',
        b'{"routed_experts":{"data":"","shape":[0,4611686018427387904,2],"dtype":"uint8"}}',
        # nesting deeper than orjson parses
        b'{"routed_experts":' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
)
def test_edge_bodies_raise_r3data_errors(raw):
    with pytest.raises(R3DataError):
        load_packed_body(raw, FIELDS)
    _check(raw)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(raw):
    _check(raw)


@SETTINGS
@given(st.lists(st.sampled_from(TOKENS), max_size=60).map(b"".join))
def test_token_soup(raw):
    _check(raw)


@SETTINGS
@given(mutated_bodies())
def test_mutated_bodies(raw):
    _check(raw)


@SETTINGS
@given(lying_envelopes())
def test_lying_envelopes(raw):
    _check(raw)


def _little_endian_bytes(array: np.ndarray) -> bytes:
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


@settings(max_examples=30, deadline=None)
@given(valid_bodies_and_choices())
def test_valid_bodies_always_decode(case):
    raw, built = case
    parsed = load_packed_body(raw, FIELDS)
    assert parsed["note"] == '"routed_experts": "QUJD"'
    assert len(parsed["choices"]) == len(built)
    for choice, (kind, source) in zip(parsed["choices"], built, strict=True):
        if kind == "envelope":
            assert choice.keys() == {"routed_experts", "text"}
            assert choice["text"] == "hi"
            envelope = choice["routed_experts"]
            assert envelope.keys() == {"data", "shape", "dtype", "start"}
            assert envelope["start"] == len(source)
            assert envelope["data"].dtype == source.dtype
            np.testing.assert_array_equal(envelope["data"], source)
            assert envelope["data"].tobytes() == _little_endian_bytes(source)
        elif kind == "bare":
            assert type(choice["routed_experts"]) is bytearray
            assert choice["routed_experts"] == _little_endian_bytes(source)
        elif kind == "null":
            assert choice == {"routed_experts": None}
        else:
            assert choice["sampling_mask"].keys() == {"ids", "counts"}
            for member, expected in zip(("ids", "counts"), source, strict=True):
                envelope = choice["sampling_mask"][member]
                assert envelope["dtype"] == "int32"
                assert envelope["shape"] == [len(expected)]
                assert envelope["data"].dtype == np.int32
                assert envelope["data"].tobytes() == _little_endian_bytes(expected)
