"""PackedTensor against a naive list-of-arrays model."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import PackedError, PackedIndexError
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.ragged import RaggedRows

DTYPES = [torch.uint8, torch.uint16, torch.int32, torch.int64, torch.float32, torch.bool]


@st.composite
def ragged(draw, max_batch: int = 6, max_len: int = 7):
    """A naive model (list of per-sequence arrays) and the PackedTensor built from it."""
    dtype = draw(st.sampled_from(DTYPES))
    row_shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, max_len), max_size=max_batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    model = [
        torch.from_numpy(rng.integers(0, 200, size=(n, *row_shape))).to(dtype) for n in lengths
    ]
    packed = PackedTensor.from_segments(model) if model else PackedTensor.empty(row_shape, dtype)
    return model, packed


def assert_matches(packed: PackedTensor, model: list[torch.Tensor]) -> None:
    assert len(packed) == len(model)
    assert packed.offsets[0] == 0
    assert list(packed.lengths) == [m.shape[0] for m in model]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == packed.offsets.tolist()
    assert packed.values.shape[0] == packed.total_rows
    for segment, expected in zip(packed, model, strict=True):
        assert torch.equal(segment, expected)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@settings(max_examples=40, deadline=None)
@given(ragged())
def test_construction_and_segments_match_model(case):
    model, packed = case
    assert_matches(packed, model)
    assert PackedTensor.from_lengths(packed.values, packed.lengths) == packed
    if model:
        assert torch.equal(packed[-1], model[-1])
        assert shares_storage(packed.segment(0), packed.values)


@settings(max_examples=40, deadline=None)
@given(ragged(), st.integers(-8, 8), st.integers(-8, 8), st.sampled_from([None, 1, 2, -1, 3]))
def test_slices_are_views_when_contiguous(case, start, stop, step):
    model, packed = case
    sliced = packed[start:stop:step]
    assert_matches(sliced, model[start:stop:step])
    if step in (None, 1) and sliced.total_rows:
        assert shares_storage(sliced.values, packed.values)
    elif sliced.total_rows:
        assert not shares_storage(sliced.values, packed.values)


@settings(max_examples=40, deadline=None)
@given(ragged(), st.data())
def test_index_lists_and_masks_gather_copies(case, data):
    model, packed = case
    batch = len(model)
    picks = data.draw(st.lists(st.integers(-batch, batch - 1), max_size=8)) if batch else []
    gathered = packed[picks]
    assert_matches(gathered, [model[i] for i in picks])
    mask = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    masked = packed[np.array(mask, dtype=bool)]
    assert_matches(masked, [m for m, keep in zip(model, mask, strict=True) if keep])
    assert_matches(packed[torch.tensor(picks, dtype=torch.int64)], [model[i] for i in picks])
    if gathered.total_rows:
        assert not shares_storage(gathered.values, packed.values)


@settings(max_examples=30, deadline=None)
@given(ragged(), st.integers(0, 3))
def test_cat_repeat_and_repeat_interleave(case, n):
    model, packed = case
    assert_matches(PackedTensor.cat([packed, packed[1:]]), model + model[1:])
    assert_matches(packed.repeat(n), model * n)
    assert_matches(packed.repeat_interleave(n), [m for m in model for _ in range(n)])


@settings(max_examples=30, deadline=None)
@given(ragged(), st.sampled_from(["left", "right"]), st.integers(0, 3))
def test_padded_round_trip(case, side, extra):
    model, packed = case
    longest = max((m.shape[0] for m in model), default=0)
    fill = 1 if packed.dtype == torch.bool else 7  # a bool holds 0 and 1, no other fill
    rect = packed.padded(fill=fill, side=side, max_len=longest + extra)
    assert rect.shape == (len(model), longest + extra, *packed.row_shape)
    for b, m in enumerate(model):
        n = m.shape[0]
        real = rect[b, :n] if side == "right" else rect[b, rect.shape[1] - n :]
        pad = rect[b, n:] if side == "right" else rect[b, : rect.shape[1] - n]
        assert torch.equal(real, m)
        assert bool((pad == torch.tensor(fill).to(rect.dtype)).all())
    assert PackedTensor.from_padded(rect, packed.lengths, side) == packed


@settings(max_examples=30, deadline=None)
@given(ragged(), st.sampled_from([2, 5]))
def test_pickle_round_trip_keeps_values_out_of_band(case, protocol):
    model, packed = case
    buffers: list[pickle.PickleBuffer] = []
    callback = buffers.append if protocol == 5 else None
    blob = pickle.dumps(packed, protocol=protocol, buffer_callback=callback)
    restored = pickle.loads(blob, buffers=buffers)
    assert restored == packed
    assert_matches(restored, model)
    if protocol == 5:
        assert len(buffers) == 1
        assert len(blob) < 400  # only the header travels in band
        if packed.total_rows:
            assert restored.values.data_ptr() == packed.values.data_ptr()


def test_numpy_views_and_from_segments_accept_numpy():
    packed = PackedTensor.from_segments(
        [np.arange(6, dtype=np.int32).reshape(3, 2), np.zeros((0, 2), np.int32)]
    )
    views = packed.numpy()
    assert [v.shape for v in views] == [(3, 2), (0, 2)]
    views[0][0, 0] = 99
    assert int(packed.values[0, 0]) == 99
    assert PackedTensor.from_segments(views) == packed
    readonly = np.frombuffer(bytes(8), dtype=np.int32).reshape(2, 1)
    assert PackedTensor.from_segments([readonly]).total_rows == 2
    reversed_rows = np.arange(6, dtype=np.int32).reshape(3, 2)[::-1]
    assert PackedTensor.from_segments([reversed_rows])[0].tolist() == [[4, 5], [2, 3], [0, 1]]
    big_endian = np.arange(3, dtype=">u2")
    assert PackedTensor.from_lengths(big_endian, [3]).values.tolist() == [0, 1, 2]


def test_to_contiguous_and_repr():
    packed = PackedTensor.from_lengths(torch.arange(12).reshape(6, 2).t().contiguous().t(), [2, 4])
    assert not packed.values.is_contiguous()
    compact = packed.contiguous()
    assert compact.values.is_contiguous()
    assert compact == packed
    cast = packed.to(dtype=torch.int32)
    assert cast.dtype == torch.int32
    assert cast.offsets is packed.offsets
    assert (
        repr(packed) == "PackedTensor(B=2, rows=6, row_shape=(2,), dtype=torch.int64, device=cpu)"
    )
    assert packed != cast
    assert packed.__eq__("x") is NotImplemented


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs an accelerator")
def test_pin_memory():
    packed = PackedTensor.from_lengths(torch.arange(4), [1, 3]).pin_memory()
    assert packed.values.is_pinned()


class _Unreadable:
    """Stands in for a device tensor: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"device cu_seqlens was read ({name})")


def test_host_offsets_never_read_the_device_copy():
    packed = PackedTensor.from_lengths(torch.arange(10), [3, 0, 7])
    packed._device_cu_seqlens = _Unreadable()
    assert len(packed) == 3
    assert list(packed.lengths) == [3, 0, 7]
    assert list(packed.sequence_lengths) == [3, 0, 7]
    assert packed.segment(2).shape[0] == 7
    assert packed[1:].total_rows == 7
    assert packed[[2, 0]].total_rows == 10
    assert packed.max_length() == 7
    assert packed.padded().shape == (3, 7)


def test_given_cu_seqlens_is_kept_as_a_private_copy():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed = PackedTensor(torch.zeros(5), cu)
    cu[1] = 4  # the caller's tensor changes; the batch's boundaries must not
    assert packed.cu_seqlens.tolist() == [0, 2, 5] == packed.offsets.tolist()


@pytest.mark.parametrize(
    ("values", "cu_seqlens", "message"),
    [
        ([1, 2], [0, 2], "values must be a torch.Tensor"),
        (torch.tensor(3), [0], "row dimension"),
        (torch.zeros(3), [], r"B\+1 >= 1"),
        (torch.zeros(3), [1, 3], "start at 0"),
        (torch.zeros(3), [0, 2], "end at the number of rows 3, found 2"),
        (torch.zeros(3), [0, 2, 1, 3], "non-decreasing, found 2 then 1"),
        # a difference of neighbours wraps around int64; the comparison does not
        (torch.zeros(3), [0, 2**62, -(2**63), -(2**62), 3], f"non-decreasing, found {2**62} then"),
        (torch.zeros(3), [[0, 3]], "1-D"),
        (torch.zeros(3), [0.0, 3.0], "integers"),
        (torch.zeros(3), torch.tensor([0.0, 3.0]), "integers"),
    ],
)
def test_invalid_construction_names_expected_and_found(values, cu_seqlens, message):
    with pytest.raises(PackedError, match=message):
        PackedTensor(values, cu_seqlens)


def test_operation_errors():
    packed = PackedTensor.from_lengths(torch.arange(5), [2, 3])
    with pytest.raises(PackedIndexError, match=r"in \[-2, 2\), found 2"):
        packed.segment(2)
    with pytest.raises(IndexError):
        packed[[0, 5]]
    with pytest.raises(PackedError, match="boolean mask must have shape"):
        packed[np.array([True])]
    with pytest.raises(PackedError, match="1-D list of ints"):
        packed[np.array([0.5])]
    with pytest.raises(PackedError, match="lengths must be >= 0"):
        PackedTensor.from_lengths(torch.arange(5), [6, -1])
    with pytest.raises(PackedError, match="needs row_shape and dtype"):
        PackedTensor.from_segments([])
    assert PackedTensor.from_segments([], row_shape=(2,), dtype=torch.uint8).row_shape == (2,)
    with pytest.raises(PackedError, match="segment 1 must have row shape"):
        PackedTensor.from_segments([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(PackedError, match="at least one"):
        PackedTensor.cat([])
    with pytest.raises(PackedError, match="part 1 must have row shape"):
        PackedTensor.cat([packed, PackedTensor.from_lengths(torch.zeros(2, 2), [2])])
    with pytest.raises(PackedError, match="repeat count"):
        packed.repeat(-1)
    with pytest.raises(PackedError, match="max_len must be >= the longest sequence 3"):
        packed.padded(max_len=2)
    with pytest.raises(PackedError, match="side must be"):
        packed.padded(side="middle")
    with pytest.raises(PackedError, match=r"padded must be \[B=2"):
        PackedTensor.from_padded(torch.zeros(3, 4), [1, 1])
    with pytest.raises(PackedError, match="lengths must be <= max_len 4"):
        PackedTensor.from_padded(torch.zeros(2, 4), [5, 1])
    with pytest.raises(PackedError, match="numeric or bool"):
        PackedTensor.from_segments([np.array(["a"])])
    with pytest.raises(PackedError, match=r"torch\.Tensor or numpy\.ndarray"):
        PackedTensor.from_segments([[1, 2]])


def test_corrupt_pickle_is_rejected():
    packed = PackedTensor.from_lengths(torch.arange(4, dtype=torch.int32), [4])
    rebuild, (state, offsets) = packed.__reduce_ex__(2)
    data, dtype, shape = state
    with pytest.raises(PackedError, match="needs 16 bytes, found 12"):
        rebuild((data[:12], dtype, shape), offsets)
    with pytest.raises(PackedError, match="torch dtype"):
        rebuild((data, "torch.nonsense", shape), offsets)
    with pytest.raises(PackedError, match="end at the number of rows 4, found 5"):
        rebuild(state, [0, 5])


def test_padded_is_bounded_like_the_ragged_views_before_allocating():
    # one long sequence and many short ones: the rectangle is B * longest rows
    lengths = [1 << 14] + [1] * ((1 << 14) - 1)
    packed = PackedTensor.from_lengths(
        torch.zeros((sum(lengths), 48, 8), dtype=torch.uint8), lengths
    )
    with pytest.raises(
        PackedError,
        match=r"a padded view \[16384, 16384, 48, 8\] has 103079215104 cells, more than "
        r"max_cells 268435456; keep the rows packed or pass a larger max_cells",
    ):
        packed.padded()  # was 96 GiB
    with pytest.raises(PackedError, match=r"\[2, 1099511627776\] has .* more than max_cells"):
        PackedTensor.from_lengths(torch.arange(5), [2, 3]).padded(max_len=1 << 40)
    small = PackedTensor.from_lengths(torch.arange(6).reshape(3, 2), [1, 2])
    assert small.padded(max_cells=8).shape == (2, 2, 2)
    with pytest.raises(PackedError, match=r"\[2, 2, 2\] has 8 cells, more than max_cells 7"):
        small.padded(max_cells=7)


def test_numpy_arrays_torch_cannot_wrap_are_copied_or_refused_typed():
    """torch.from_numpy refuses strides that are no multiple of the item size (a field of a
    structured array) with a bare ValueError, and extended precision with a TypeError."""
    records = np.zeros(4, dtype=[("tag", "u1"), ("ids", "<i4")])
    records["ids"] = [3, 1, 4, 1]
    packed = PackedTensor.from_lengths(records["ids"], [1, 3])
    assert packed.values.tolist() == [3, 1, 4, 1]
    with pytest.raises(PackedError, match="expected a numeric or bool array torch holds"):
        PackedTensor.from_segments([np.zeros((2, 3), np.longdouble)])


def test_to_takes_a_dtype_first_as_torch_does():
    """``values.to(torch.int32)`` is torch's; ``packed.to(torch.int32)`` handed the dtype to
    torch as a device (a TypeError about ``device=torch.dtype``)."""
    packed = PackedTensor.from_lengths(torch.arange(6, dtype=torch.uint8).reshape(3, 2), [1, 2])
    cast = packed.to(torch.int32)
    assert cast.dtype == torch.int32
    assert cast.offsets is packed.offsets
    assert cast.values.tolist() == packed.values.int().tolist()
    assert packed.to("cpu", torch.int64).dtype == torch.int64
    with pytest.raises(PackedError, match="dtype given twice"):
        packed.to(torch.int32, torch.int64)
    ragged = PackedRagged.from_samples([RaggedRows.from_rows([[1, 2], [3]])])
    assert ragged.to(torch.int64).dtype == torch.int64


def test_lengths_whose_sum_wraps_around_int64_are_named():
    """The running sum wrapped to a negative total: "must end at the number of rows 3, found
    -9223372036854775805", as if the lengths had summed to that."""
    with pytest.raises(PackedError, match=r"lengths must sum to at most 2\*\*63 - 1 rows"):
        PackedTensor.from_lengths(torch.zeros(3), [2**62, 2**62, 3])


def test_uint64_lengths_or_offsets_past_int64_are_named_not_wrapped():
    """2**63 as uint64 became -2**63 on the cast: 'lengths must be >= 0, found -9223...'."""
    big = np.array([1, 2**63], dtype=np.uint64)
    with pytest.raises(
        PackedError, match=r"lengths must be at most 2\*\*63 - 1, found 9223372036854775808"
    ):
        PackedTensor.from_lengths(torch.zeros(1), big)
    with pytest.raises(PackedError, match=r"cu_seqlens must be at most 2\*\*63 - 1, found 9223"):
        PackedTensor(torch.zeros(1), np.array([0, 2**63], dtype=np.uint64))
    with pytest.raises(PackedError, match="lengths must hold integers, found dtype float64"):
        PackedTensor.from_lengths(torch.zeros(1), np.array([1.0]))
