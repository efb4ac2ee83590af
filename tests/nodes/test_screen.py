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
    st.integers(0, 2**32 - 1),
)
def test_screen_matches_a_naive_reference(dtype, rows, row_shape, experts, zero_rows, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    low = max(info.min, -3)
    high = min(info.max, (experts or 16) + 3)
    array = rng.integers(low, high + 1, (rows, *row_shape)).astype(dtype)
    if rows:
        array[rng.integers(0, rows)] = 0  # a zero row (an engine bug), often
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
