"""The one screen against a naive reference: every dtype, row shape, id range and policy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.nodes.screen import ScreenOptions, screen_rows
from r3data.wire.dtypes import ROUTE_DTYPES

DTYPES = [*ROUTE_DTYPES, np.dtype("int8"), np.dtype("int16")]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.integers(0, 12),
    st.sampled_from([(3, 2), (1, 1), (5, 3), (2, 8), (7,)]),
    st.sampled_from([None, 1, 2, 7, 8, 64, 128, 200, 256, 300]),
    st.sampled_from(["missing", "raise", "keep"]),
    st.sampled_from([0.0, 0.5, 0.9]),
    st.integers(0, 2**32 - 1),
)
def test_screen_matches_a_naive_reference(
    dtype, rows, row_shape, experts, zero_rows, sparsity, seed
):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    low = max(info.min, -3)
    high = min(info.max, (experts or 16) + 3)
    array = rng.integers(low, high + 1, (rows, *row_shape)).astype(dtype)
    array[rng.random(array.shape) < sparsity] = 0  # rows zero in some words, not all
    if rows:
        array[rng.integers(0, rows, size=rng.integers(1, 3))] = 0  # zero rows, row 0 too
    flags = screen_rows(array, ScreenOptions(num_experts=experts, zero_rows=zero_rows))
    flat = array.reshape(rows, int(np.prod(row_shape)))
    zero = ~flat.any(axis=1)
    negative = (flat < 0).any(axis=1)
    expect_zero = None if zero_rows == "keep" or not zero.any() else zero
    expect_negative = negative if negative.any() else None
    for got, want in ((flags.zero, expect_zero), (flags.negative, expect_negative)):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got, want)
    over = experts is not None and (flat >= experts).any()
    assert (flags.too_large is not None) == bool(over)
    if over:
        row, entry, value = flags.too_large
        assert value == flat[row, entry] >= experts
        first = np.flatnonzero((flat >= experts).reshape(-1))[0]
        assert (row, entry) == np.unravel_index(first, flat.shape)


def test_rows_zero_in_the_probed_word_only_are_not_zero_rows():
    rows = np.arange(1, 4 * 2 * 8 + 1, dtype=np.uint8).reshape(4, 2, 8)
    rows[1, 0] = 0  # the first word of the row (its first layer) zero, the rest not
    rows[2] = 0  # a zero row
    flags = screen_rows(rows, ScreenOptions())
    np.testing.assert_array_equal(flags.zero, [False, False, True, False])
    rows[0] = 0  # the first row zero: no word to probe, every row looked at whole
    np.testing.assert_array_equal(
        screen_rows(rows, ScreenOptions()).zero, [True, False, True, False]
    )
