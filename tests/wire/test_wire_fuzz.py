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
from r3data.wire import load_packed_body, pack_csr, pack_ndarray

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
def valid_bodies(draw) -> bytes:
    choices = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(0, 4))
        routes = np.arange(rows * 6, dtype=np.uint8).reshape(rows, 3, 2)
        kind = draw(st.sampled_from(["envelope", "bare", "null", "mask"]))
        if kind == "envelope":
            choices.append({"routed_experts": pack_ndarray(routes, start=rows), "text": "hi"})
        elif kind == "bare":
            choices.append({"routed_experts": pack_ndarray(routes)["data"]})
        elif kind == "null":
            choices.append({"routed_experts": None})
        else:
            choices.append({"sampling_mask": pack_csr([1, 2, 3], [1, 2])})
    return orjson.dumps({"choices": choices, "note": '"routed_experts": "QUJD"'})


@st.composite
def mutated_bodies(draw) -> bytes:
    raw = bytearray(draw(valid_bodies()))
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


@settings(max_examples=30, deadline=None)
@given(valid_bodies())
def test_valid_bodies_always_decode(raw):
    parsed = load_packed_body(raw, FIELDS)
    for choice, original in zip(parsed["choices"], orjson.loads(raw)["choices"], strict=True):
        if isinstance(original.get("routed_experts"), dict):
            assert choice["routed_experts"]["data"].shape == tuple(
                original["routed_experts"]["shape"]
            )
