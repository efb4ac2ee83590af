"""RaggedRows and PackedRagged: CSR rows on the host and in a batch, against plain lists."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data import TensorBatch
from r3data.errors import PackedError, PackedIndexError
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.ragged import RaggedRows

rows_strategy = st.lists(st.lists(st.integers(0, 1000), max_size=6), max_size=8)
samples_strategy = st.lists(rows_strategy, max_size=5)


def _ragged(rows: list[list[int]]) -> RaggedRows:
    return RaggedRows.from_rows(rows)


@settings(max_examples=60, deadline=None)
@given(rows_strategy, st.integers(0, 8), st.integers(0, 8))
def test_ragged_rows_round_trip_and_slice_like_lists(rows, lo, hi):
    ragged = _ragged(rows)
    assert ragged.rows == len(rows)
    assert ragged.lengths.tolist() == [len(r) for r in rows]
    padded = ragged.padded()
    assert padded.shape == (len(rows), max((len(r) for r in rows), default=0))
    assert RaggedRows.from_padded(padded) == ragged
    part = ragged[lo:hi]
    want = rows[lo:hi]
    assert part.lengths.tolist() == [len(r) for r in want]
    values, offsets = part.compact()
    assert values.tolist() == [v for r in want for v in r]
    assert offsets[0] == 0
    assert np.shares_memory(part.values, ragged.values) or not part.values.size


def test_ragged_rows_refuse_what_is_not_csr():
    with pytest.raises(PackedError, match="non-decreasing"):
        RaggedRows(np.arange(4), [0, 3, 2])
    with pytest.raises(PackedError, match="summing to the 4 values"):
        RaggedRows.from_lengths(np.arange(4), [1, 2])
    with pytest.raises(PackedError, match="row 1 has -1 before a kept id"):
        RaggedRows.from_padded([[1, 2], [-1, 3]])
    with pytest.raises(PackedError, match="more than max_cells 4"):
        _ragged([[1, 2, 3], [4]]).padded(max_cells=4)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_unsigned_rows_cannot_hold_the_fill_so_its_wrapped_value_is_refused(dtype):
    top = np.iinfo(dtype).max
    # -1 padding cast to an unsigned dtype is its max: padding or an id? refused, not read
    with pytest.raises(
        PackedError,
        match=rf"mask: expected rows padded with -1, which {np.dtype(dtype)} cannot hold; "
        rf"found {top} \(-1 wrapped\?\) at row 1, column 1; pass fill={top} if it is padding",
    ):
        RaggedRows.from_padded(np.array([[1, 2], [3, top]], dtype), what="mask")
    # nothing there can be padding: every value is an id (e.g. a top-k mask, all rows full)
    full = RaggedRows.from_padded(np.array([[1, 2], [3, 4]], dtype))
    assert full == RaggedRows.from_rows([[1, 2], [3, 4]], dtype=dtype)
    padded = RaggedRows.from_padded(np.array([[1, top], [3, 4]], dtype), fill=top)
    assert padded == RaggedRows.from_rows([[1], [3, 4]], dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(samples_strategy, st.data())
def test_packed_ragged_batch_algebra_matches_per_sample_lists(samples, data):
    packed = PackedRagged.from_samples([_ragged(s) for s in samples], np.int32)
    assert len(packed) == len(samples)
    assert packed.lengths.tolist() == [len(s) for s in samples]
    for i, sample in enumerate(samples):
        got = packed[i]
        assert got.lengths.tolist() == [len(r) for r in sample]
        assert got.compact()[0].tolist() == [v for r in sample for v in r]
    picks = data.draw(st.lists(st.integers(0, max(len(samples) - 1, 0)), max_size=6))
    if samples:
        gathered = packed.gather(picks)
        assert [gathered[j].lengths.tolist() for j in range(len(picks))] == [
            [len(r) for r in samples[p]] for p in picks
        ]
    lo = data.draw(st.integers(0, len(samples)))
    assert packed[lo:] == PackedRagged.from_samples([_ragged(s) for s in samples[lo:]], np.int32)
    both = PackedRagged.cat([packed, packed])
    assert len(both) == 2 * len(samples)
    assert pickle.loads(pickle.dumps(packed, protocol=5)) == packed
    padded = packed.padded(fill=-1)
    widest = max((len(r) for s in samples for r in s), default=0)
    assert padded.row_shape == (widest,)
    assert packed.values.numel() == sum(len(r) for s in samples for r in s)  # each id once


def test_a_batch_holds_ragged_fields_aligned_with_the_rest():
    masks = PackedRagged.from_samples([_ragged([[1, 2], [3]]), _ragged([[4], [], [5, 6, 7]])])
    batch = TensorBatch({"mask": masks, "score": torch.tensor([0.5, 1.5])})
    picked = batch.gather([1])
    assert picked["mask"][0].lengths.tolist() == [1, 0, 3]
    assert float(picked["score"][0]) == 1.5
    assert TensorBatch.cat([batch, batch])["mask"].lengths.tolist() == [2, 3, 2, 3]
    assert batch.slice(1, 2)["mask"].total_rows == 3


def test_packed_ragged_refuses_what_a_packed_tensor_refuses():
    """Both packed types index and repeat through one definition: the same errors."""
    masks = PackedRagged.from_samples([_ragged([[1, 2], [3]]), _ragged([[4]])])
    with pytest.raises(PackedIndexError, match=r"segment index must be in \[-2, 2\), found 2"):
        masks[2]
    with pytest.raises(PackedIndexError, match=r"segment index must be in \[-2, 2\), found 2"):
        masks.rows[:2].gather([0, 1])[2]
    with pytest.raises(PackedError, match="repeat count: expected an int >= 0, found -1"):
        masks.repeat(-1)
    with pytest.raises(PackedError, match="repeat count: expected an int >= 0, found -1"):
        masks.repeat_interleave(-1)
    assert masks[-1].lengths.tolist() == [1]
    assert masks[1:1].total_rows == 0


def test_packed_ragged_offsets_that_wrap_around_int64_are_refused():
    """Sample offsets are compared neighbour to neighbour: their differences wrap around
    int64, and ``[0, 2**62, -2**63, -2**62, 3]`` looked non-decreasing to them."""
    rows = PackedTensor(torch.arange(3), [0, 1, 2, 3])
    with pytest.raises(PackedError, match="expected non-decreasing offsets from 0 to the 3"):
        PackedRagged(rows, [0, 2**62, -(2**63), -(2**62), 3])


ODD = 2**53 + 1
"""An int64 id that float64 cannot hold: numpy joins int64 and uint64 arrays as float64."""


def test_rows_of_mixed_integer_dtypes_keep_every_id_exactly():
    """Joined first, then cast, int64 and uint64 rows went through float64: 2**53 + 1 came
    out as 2**53 with no error, and with no dtype given the batch's ids were floats."""
    mixed = [np.array([ODD], np.int64), np.array([5], np.uint64)]
    assert RaggedRows.from_rows(mixed, dtype=np.int64).values.tolist() == [ODD, 5]
    samples = [RaggedRows.from_rows(mixed[:1], np.int64), RaggedRows(mixed[1], [0, 1])]
    assert PackedRagged.from_samples(samples, dtype=np.int64).values.tolist() == [ODD, 5]
    joined = PackedRagged.from_samples(samples)
    assert joined.dtype == torch.int64
    assert joined.values.tolist() == [ODD, 5]
    with pytest.raises(PackedError, match="do not fit int64 exactly: found 18446744073709551615"):
        PackedRagged.from_samples(
            [samples[0], RaggedRows(np.array([2**64 - 1], np.uint64), [0, 1])]
        )
