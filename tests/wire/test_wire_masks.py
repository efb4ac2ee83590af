"""CSR sampling masks <-> padded rows, and per-token floats with a -inf sentinel."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, PackedError, WireFormatError
from r3data.wire import (
    MASK_FILL,
    NEG_INF_SENTINEL,
    csr_to_padded,
    floats_from_json,
    floats_to_json,
    load_packed_body,
    pack_csr,
    padded_to_csr,
    primerl_sampling_mask,
    unpack_csr,
)
from r3data.wire.masks import DEFAULT_MAX_ELEMENTS, DEFAULT_MAX_PADDING

SETTINGS = settings(max_examples=50, deadline=None)

ragged_sets = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=8)


def _csr(sets):
    ids = np.array([i for kept in sets for i in kept], dtype=np.int32)
    counts = np.array([len(kept) for kept in sets], dtype=np.int32)
    return ids, counts


@SETTINGS
@given(ragged_sets)
def test_csr_padded_round_trip(sets):
    ids, counts = _csr(sets)
    padded = csr_to_padded(ids, counts)
    widest = max((len(kept) for kept in sets), default=0)
    assert padded.shape == (len(sets), widest)
    assert padded.dtype == np.int32
    for row, kept in zip(padded, sets, strict=True):
        assert row[: len(kept)].tolist() == kept
        assert (row[len(kept) :] == MASK_FILL).all()
    back_ids, back_counts = padded_to_csr(padded)
    np.testing.assert_array_equal(back_ids, ids)
    np.testing.assert_array_equal(back_counts, counts)


@SETTINGS
@given(ragged_sets, st.integers(0, 3))
def test_padded_csr_round_trip_with_extra_padding(sets, extra):
    padded = csr_to_padded(*_csr(sets))
    wider = np.pad(padded, ((0, 0), (0, extra)), constant_values=MASK_FILL)
    np.testing.assert_array_equal(csr_to_padded(*padded_to_csr(wider)), padded)


@SETTINGS
@given(ragged_sets)
def test_csr_envelopes_round_trip_raw_and_spliced(sets):
    ids, counts = _csr(sets)
    body = orjson.dumps({"choices": [{"sampling_mask": pack_csr(ids, counts)}]})
    for parsed in (orjson.loads(body), load_packed_body(body, ("sampling_mask",))):
        got_ids, got_counts = unpack_csr(parsed["choices"][0]["sampling_mask"])
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_counts, counts)


@pytest.mark.parametrize(
    ("ids", "counts", "match"),
    [
        ([1, 2], [1], r"len\(ids\) == sum\(counts\) == 1, found 2"),
        ([1], [2, -1], "sizes >= 0, found -1 at token 1"),
        ([-1, 2], [2], r"token ids in \[0, 2147483647\], found \[-1, 2\]"),
        ([2**31], [1], "found"),
        ([1.5], [1], "integer array"),
        ([[1]], [1], "1-D"),
    ],
)
def test_csr_rejects(ids, counts, match):
    with pytest.raises(WireFormatError, match=match):
        csr_to_padded(ids, counts)


def test_csr_to_padded_checks_size_before_allocating():
    counts = np.zeros(10**6, np.int32)
    counts[0] = 10**6
    with pytest.raises(WireFormatError, match=r"\[1000000, 1000000\] exceeds"):
        csr_to_padded(np.zeros(10**6, np.int32), counts)


def _skewed(tokens: int, widest: int) -> tuple[np.ndarray, np.ndarray]:
    """One kept set of ``widest`` ids among ``tokens - 1`` empty ones: padding it costs
    ``tokens * widest`` cells for ``tokens + widest`` values present."""
    counts = np.zeros(tokens, np.int32)
    counts[-1] = widest
    return np.arange(widest, dtype=np.int32), counts


def test_a_small_body_cannot_claim_a_huge_padded_mask():
    """~175 KB of base64 whose padded form would be [16384, 16384] int32: 1 GiB. Decoded it
    stays ragged (CSR), and padding it is refused unless asked for and bounded."""
    ids, counts = _skewed(1 << 14, 1 << 14)
    assert counts.size * int(counts.max()) == DEFAULT_MAX_ELEMENTS
    raw = orjson.dumps(
        {"choices": [{"prompt_token_ids": [1], "sampling_mask": pack_csr(ids, counts)}]}
    )
    assert len(raw) < 200_000
    tracemalloc.start()
    try:
        (mask,) = primerl_sampling_mask(raw)
        with pytest.raises(
            WireFormatError,
            match=r"expected a padded form of at most 1024 x the 32768 ids and counts present, "
            r"found \[16384, 16384\] = 268435456 cells",
        ):
            csr_to_padded(*mask.array.compact()[:1], mask.array.lengths)
        with pytest.raises(PackedError, match="more than max_cells 1000000"):
            mask.array.padded(max_cells=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * len(raw)
    assert (mask.rows, mask.array.widest) == (1 << 14, 1 << 14)
    # the caller who wants it padded anyway says so
    (small,) = primerl_sampling_mask(
        orjson.dumps(
            {
                "choices": [
                    {"prompt_token_ids": [1], "sampling_mask": pack_csr(*_skewed(3000, 1000))}
                ]
            }
        )
    )
    assert small.array.padded().shape == (3000, 1000)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 8_000),
    st.integers(0, DEFAULT_MAX_PADDING),
    st.floats(0, 1),
    st.integers(0, 2**32 - 1),
)
def test_masks_no_wider_than_max_padding_always_pass(tokens, widest, density, seed):
    """However sparse (most sets empty), a mask whose widest set fits the ratio passes."""
    rng = np.random.default_rng(seed)
    counts = np.where(rng.random(tokens) < density, rng.integers(0, widest + 1, tokens), 0)
    counts = counts.astype(np.int32)
    counts[0] = widest
    ids = np.zeros(int(counts.sum()), np.int32)
    assert csr_to_padded(ids, counts).shape == (tokens, widest)


def test_padding_bound():
    # wide and skewed, but small: always allowed
    small = csr_to_padded(*_skewed(2048, 2048))
    assert small.shape == (2048, 2048)
    ids, counts = _skewed(8192, 2048)  # 16M cells for 10240 values present
    with pytest.raises(WireFormatError, match=r"at most 1024 x the 10240 ids .*\[8192, 2048\]"):
        csr_to_padded(ids, counts)
    with pytest.raises(WireFormatError, match="at most 8 x the 10240"):
        csr_to_padded(ids, counts, max_padding=8)
    assert csr_to_padded(ids, counts, max_padding=2048).shape == (8192, 2048)
    assert csr_to_padded(ids, counts, max_padding=None).shape == (8192, 2048)
    with pytest.raises(WireFormatError, match=r"\[8192, 2048\] exceeds 1000000 elements"):
        csr_to_padded(ids, counts, max_elements=10**6, max_padding=None)
    for bad in (0, -1.5, "64", True):
        with pytest.raises(ConfigError, match="max_padding: expected a number > 0 or None"):
            csr_to_padded(ids, counts, max_padding=bad)


@pytest.mark.parametrize(
    ("padded", "match"),
    [
        ([[1, -1, 2]], "row 0 has -1 before a kept id"),
        ([[1, 2], [-1, 3]], "row 1 has -1"),
        ([[1, -5]], r"found \[-5, 1\]"),
        ([1, 2], "integer array"),
        ([[0.5]], "integer array"),
    ],
)
def test_padded_rejects(padded, match):
    with pytest.raises(WireFormatError, match=match):
        padded_to_csr(padded)


def test_unpack_csr_rejects():
    with pytest.raises(WireFormatError, match="'ids' and 'counts'"):
        unpack_csr({"ids": None})
    mask = pack_csr([1, 2], [2])
    mask["ids"]["dtype"] = "uint8"
    mask["ids"]["shape"] = [8]
    with pytest.raises(WireFormatError, match="int32"):
        unpack_csr(mask)


@SETTINGS
@given(
    st.lists(
        st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=0.0)
        | st.just(float("-inf")),
        max_size=12,
    )
)
def test_floats_round_trip_through_json(values):
    array = np.array(values, dtype=np.float32)
    text = orjson.dumps(floats_to_json(array))
    assert b"null" not in text
    back = floats_from_json(orjson.loads(text))
    np.testing.assert_array_equal(back, array)
    assert back.dtype == np.float32


def test_sentinel_and_null_read_as_neg_inf():
    assert float(np.finfo(np.float32).min) == NEG_INF_SENTINEL
    assert floats_to_json([0.0, float("-inf")]) == [0.0, NEG_INF_SENTINEL]
    assert json.loads(json.dumps(floats_to_json([float("-inf")])))[0] == NEG_INF_SENTINEL
    back = floats_from_json([None, NEG_INF_SENTINEL, -1e300, -9999.0], dtype=np.float64)
    assert back.tolist() == [float("-inf")] * 3 + [-9999.0]


@pytest.mark.parametrize("bad", [[float("nan")], [float("inf")], [[0.0]]])
def test_floats_to_json_rejects(bad):
    with pytest.raises(WireFormatError):
        floats_to_json(bad)


@pytest.mark.parametrize("bad", [["x"], [[0.0, 1.0]], [{"a": 1}]])
def test_floats_from_json_rejects(bad):
    with pytest.raises(WireFormatError):
        floats_from_json(bad)
