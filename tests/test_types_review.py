"""Adversarial review of the core batch types: each against an obviously correct reference
(a per-sample loop, a set of positions), with hostile inputs that must fail typed."""

from __future__ import annotations

import collections
import copy
import enum
import gc
import itertools
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data import loader
from r3data.batch import PerSample, TensorBatch, merge_metadata
from r3data.buffers import POOL_MIN_BYTES, BufferPool, empty_rows
from r3data.errors import ConfigError, PackedError, PackedIndexError
from r3data.options import as_options, checked_keywords, options
from r3data.packed import PackedTensor, aranges
from r3data.packed_ragged import PackedRagged
from r3data.ragged import RaggedRows
from r3data.spans import complement, format_spans, intersect, merge
from r3data.validate import checked_fill, checked_int

DTYPES = [torch.bool, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.int64]
DTYPES += [torch.float32, torch.bfloat16]


# --- references ----------------------------------------------------------------------------


def padded_reference(segments: list[torch.Tensor], fill, side: str, max_len: int, row_shape):
    """The padded rectangle built one sample at a time."""
    dtype = segments[0].dtype if segments else torch.float32
    out = []
    for seg in segments:
        pad = torch.full((max_len - seg.shape[0], *row_shape), fill, dtype=dtype)
        out.append(torch.cat([seg, pad] if side == "right" else [pad, seg]))
    return torch.stack(out) if out else None


def positions(spans) -> set[int]:
    return {p for lo, hi in spans for p in range(lo, hi)}


def assert_ordered_disjoint(spans) -> None:
    for lo, hi in spans:
        assert lo < hi, spans
    for (_, hi), (lo, _) in itertools.pairwise(spans):
        assert hi <= lo, spans


@st.composite
def segments(draw, max_batch: int = 5, max_len: int = 6):
    dtype = draw(st.sampled_from(DTYPES))
    row_shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, max_len), max_size=max_batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    segs = [torch.from_numpy(rng.integers(0, 2, size=(n, *row_shape))).to(dtype) for n in lengths]
    if dtype != torch.bool:
        segs = [s * 37 for s in segs]
    return segs, row_shape, dtype


spans_strategy = st.lists(st.tuples(st.integers(-3, 20), st.integers(-3, 20)), max_size=6)


# --- bugs: each test failed before its fix -------------------------------------------------


def test_complement_of_an_empty_range_is_empty():
    assert complement([(10, 12)], 5, 5) == []  # was [(5, 5)]
    assert complement([(10, 12)], 7, 3) == []  # was [(7, 3)]
    assert complement([], 4, 4) == []


def test_pool_with_no_free_mappings_kept_still_hands_out_buffers():
    pool = BufferPool(max_free=0)  # was: the new mapping was trimmed (closed) before use
    first = pool.empty((POOL_MIN_BYTES,), torch.uint8)
    first.fill_(3)
    address = first.data_ptr()
    del first
    second = pool.empty((POOL_MIN_BYTES * 3,), torch.uint8)
    second.fill_(4)
    assert second.data_ptr() != address
    assert pool.nbytes == int(POOL_MIN_BYTES * 3 * pool.slack)  # the free one was unmapped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_free": -1}, "max_free: expected an int >= 0, found -1"),
        ({"max_free": True}, "max_free: expected an int >= 0, found True"),
        ({"slack": 0.5}, r"slack: expected a number in \[1, 2\], found 0.5"),
        ({"slack": float("nan")}, r"slack: expected a number in \[1, 2\], found nan"),
        ({"slack": "1.5"}, r"slack: expected a number in \[1, 2\], found '1.5'"),
    ],
)
def test_pool_options_are_checked(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BufferPool(**kwargs)  # slack 0.5 was a ValueError from numpy at the first request


def test_pool_refuses_a_negative_shape_typed():
    with pytest.raises(PackedError, match=r"buffer shape: expected an int >= 0, found -2048"):
        BufferPool().empty((-2048, -2048), torch.uint8)  # was torch's RuntimeError
    with pytest.raises(PackedError, match=r"buffer shape: expected an int >= 0, found -1"):
        empty_rows((-1, 3), torch.int32)


def test_packed_ragged_of_no_samples():
    empty = PackedRagged.from_samples([])  # was numpy's ValueError from result_type()
    assert len(empty) == 0
    assert empty.total_rows == 0
    assert empty.dtype == torch.int32
    assert empty.padded().values.shape == (0, 0)


def test_lossy_casts_are_refused_not_wrapped():
    wide = RaggedRows(np.array([5, 2**31], np.int64), [0, 1, 2])
    with pytest.raises(PackedError, match=r"do not fit int32 exactly: found 2147483648"):
        PackedRagged.from_samples([wide], np.int32)  # was -2147483648, silently
    with pytest.raises(PackedError, match=r"do not fit int32 exactly: found 1099511627776"):
        RaggedRows.from_rows([np.array([2**40])])  # was 0, silently
    with pytest.raises(PackedError, match=r"do not fit int32 exactly: found 1.7"):
        RaggedRows.from_rows([[1.7]])  # was 1, silently
    with pytest.raises(PackedError, match=r"do not fit uint8 exactly: found -1"):
        RaggedRows.from_rows([[3], [-1]], dtype=np.uint8)
    with pytest.raises(PackedError, match=r"expected numbers, found dtype object"):
        RaggedRows.from_rows([[2**70]])  # was OverflowError
    assert RaggedRows.from_rows([[1.0, 2.0], []]).values.tolist() == [1, 2]
    narrow = RaggedRows(np.array([5, 7], np.int64), [0, 1, 2])
    assert PackedRagged.from_samples([narrow], np.int16).values.tolist() == [5, 7]


def test_ragged_rows_take_only_slices_typed():
    rows = RaggedRows.from_rows([[1], [2]])
    with pytest.raises(PackedError, match="ragged rows take step-1 slices, found int"):
        rows[0]  # was AttributeError


@pytest.mark.parametrize(
    ("dtype", "fill", "message"),
    [
        (torch.uint8, -1, r"fill: expected a value torch.uint8 holds exactly, found -1"),
        (torch.uint8, 256, "found 256"),
        (torch.int64, 0.5, "found 0.5"),
        (torch.int32, float("nan"), "found nan"),
        (torch.bool, 2, "found 2"),
        (torch.uint16, "x", "found 'x'"),
    ],
)
def test_padded_fill_must_fit_the_dtype(dtype, fill, message):
    packed = PackedTensor.from_lengths(torch.arange(5).to(dtype), [2, 3])
    with pytest.raises(PackedError, match=message):
        packed.padded(fill=fill)  # uint8 -1 was 255 and int 0.5 was 0, silently


def test_padded_fill_that_fits_is_kept():
    for dtype, fill in [(torch.uint8, 255), (torch.int64, 3.0), (torch.bool, True)]:
        rect = PackedTensor.from_lengths(torch.zeros(3, dtype=dtype), [1, 2]).padded(fill)
        assert rect[0, 1].item() == fill
    rect = PackedTensor.from_lengths(torch.zeros(3), [1, 2]).padded(float("nan"))
    assert rect[0, 1].isnan()
    assert checked_fill("fill", np.int64(7), np.dtype(np.uint8)) == 7


def test_ragged_padded_fill_must_fit_typed():
    rows = RaggedRows(np.array([1, 2], np.uint16), [0, 2, 2])
    with pytest.raises(PackedError, match="holds exactly, found -1"):
        rows.padded()  # was numpy's OverflowError
    assert rows.padded(fill=0).tolist() == [[1, 2], [0, 0]]
    packed = PackedRagged.from_samples([rows])
    with pytest.raises(PackedError, match="holds exactly, found -1"):
        packed.padded()
    with pytest.raises(PackedError, match=r"padded width: expected an int >= 0, found 2\.0"):
        rows.padded(2.0, fill=0)


def test_padded_checks_side_and_max_len_before_allocating():
    packed = PackedTensor.from_lengths(torch.arange(5), [2, 3])
    with pytest.raises(PackedError, match="side must be 'left' or 'right'"):
        packed.padded(side="middle", max_len=1 << 40)  # was an allocation of 8 TiB first
    with pytest.raises(PackedError, match=r"max_len: expected an int >= 0, found 4\.0"):
        packed.padded(max_len=4.0)  # was torch's TypeError
    with pytest.raises(PackedError, match="max_len: expected an int >= 0, found True"):
        packed.padded(max_len=True)


def test_from_padded_takes_numpy_like_the_other_constructors():
    rect = np.arange(6, dtype=np.int32).reshape(2, 3)
    packed = PackedTensor.from_padded(rect, [1, 2], side="left")  # was AttributeError
    assert [s.tolist() for s in packed] == [[2], [4, 5]]
    with pytest.raises(PackedError, match=r"torch\.Tensor or numpy\.ndarray"):
        PackedTensor.from_padded([[1, 2]], [1])


def test_batch_size_is_an_int():
    with pytest.raises(PackedError, match="batch_size: expected an int >= 0, found -1"):
        TensorBatch({}, batch_size=-1)  # was a batch of -1 samples
    with pytest.raises(PackedError, match="batch_size: expected an int >= 0, found True"):
        TensorBatch({"a": torch.zeros(1)}, batch_size=True)
    assert TensorBatch({}, batch_size=np.int64(3)).batch_size == 3


def test_namedtuple_metadata_is_a_record_not_a_tuple_of_names():
    mesh = collections.namedtuple("Mesh", "tp cp")(2, 2)
    batch = TensorBatch({"x": torch.arange(4)}, {"mesh": mesh, "files": ("a", "b")})
    parts = batch.chunk(2)  # was a TypeError: Mesh() takes two arguments
    assert [p.metadata["mesh"] for p in parts] == [mesh, mesh]
    merged = TensorBatch.cat(parts).metadata
    assert merged["mesh"] is mesh  # was (2,): joined without repeats, like file names
    assert merged["files"] == ("a", "b")
    other = collections.namedtuple("Mesh", "tp cp")(1, 2)
    assert "mesh" not in merge_metadata([{"mesh": mesh}, {"mesh": other}])


def test_ragged_index_lists_are_refused_typed():
    packed = PackedTensor.from_lengths(torch.arange(5), [2, 3])
    with pytest.raises(PackedError, match="1-D list of ints or a boolean mask"):
        packed[[[0], [1, 0]]]  # was numpy's ValueError
    with pytest.raises(PackedError, match="1-D list of ints or a boolean mask"):
        TensorBatch({"a": packed})[[[0], [1, 0]]]


# --- differential tests --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(segments(), st.sampled_from(["left", "right"]), st.integers(0, 2), st.data())
def test_padded_and_from_padded_match_a_per_sample_loop(case, side, extra, data):
    segs, row_shape, dtype = case
    packed = PackedTensor.from_segments(segs, row_shape=row_shape, dtype=dtype)
    fill = 1 if dtype == torch.bool else data.draw(st.sampled_from([0, 5, 255]))
    max_len = max((s.shape[0] for s in segs), default=0) + extra
    rect = packed.padded(fill, side, max_len)
    assert rect.shape == (len(segs), max_len, *row_shape)
    if segs:
        assert torch.equal(rect, padded_reference(segs, fill, side, max_len, row_shape))
    # junk in the padding cells is not read back
    junk = rect.clone()
    for b, seg in enumerate(segs):
        pad = slice(seg.shape[0], None) if side == "right" else slice(0, max_len - seg.shape[0])
        junk[b, pad] = 1 if dtype == torch.bool else 99
    assert PackedTensor.from_padded(junk, packed.lengths, side) == packed
    # views, gathers and strided values pad the same
    picks = data.draw(st.lists(st.integers(0, len(segs) - 1), max_size=4)) if segs else []
    gathered = packed[picks]
    want = [segs[i] for i in picks]
    width = max((s.shape[0] for s in want), default=0)
    if want:
        reference = padded_reference(want, fill, side, width, row_shape)
        assert torch.equal(gathered.padded(fill, side), reference)
    tail = packed[1:]
    if len(tail):
        longest = tail.max_length()
        reference = padded_reference(segs[1:], fill, side, longest, row_shape)
        assert torch.equal(tail.padded(fill, side), reference)
    if row_shape and packed.total_rows:
        strided_values = packed.values.movedim(0, -1).contiguous().movedim(-1, 0)
        strided = PackedTensor(strided_values, packed.offsets)
        assert torch.equal(strided.padded(fill, side, max_len), rect)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 500), max_size=4), max_size=4), max_size=4))
def test_packed_ragged_padded_matches_a_per_row_loop(samples):
    packed = PackedRagged.from_samples([RaggedRows.from_rows(s) for s in samples])
    widest = max((len(r) for s in samples for r in s), default=0)
    for width in (widest, widest + 2):
        rect = packed.padded(width, fill=-1)
        assert rect.lengths.tolist() == [len(s) for s in samples]
        for i, sample in enumerate(samples):
            want = [r + [-1] * (width - len(r)) for r in sample]
            assert rect[i].tolist() == (want or [])
            assert rect[i].shape == (len(sample), width)
    for i, sample in enumerate(samples):  # each sample back as CSR, and its padded form
        rows = packed[i]
        assert [rows.values[lo:hi].tolist() for lo, hi in itertools.pairwise(rows.offsets)] == (
            sample
        )
        assert RaggedRows.from_padded(rows.padded(widest)) == rows
    for lo in range(len(samples) + 1):
        view = packed[lo:]
        assert view == PackedRagged.from_samples([RaggedRows.from_rows(s) for s in samples[lo:]])
    assert copy.deepcopy(packed) == packed
    assert pickle.loads(pickle.dumps(packed, protocol=2)) == packed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 9), max_size=5), max_size=6))
def test_ragged_from_padded_keeps_rows_and_refuses_holes(grid):
    width = max((len(r) for r in grid), default=0)
    rect = np.array([r + [-1] * (width - len(r)) for r in grid], np.int32).reshape(len(grid), width)
    rows = [list(r) for r in rect]
    holed = [i for i, r in enumerate(rows) if -1 in r and any(v != -1 for v in r[r.index(-1) :])]
    if holed:
        with pytest.raises(PackedError, match=f"row {holed[0]} has -1 before a kept id"):
            RaggedRows.from_padded(rect)
        return
    ragged = RaggedRows.from_padded(rect)
    kept = [[v for v in r if v != -1] for r in rows]
    assert ragged == RaggedRows.from_rows(kept)
    assert np.array_equal(ragged.padded(width), rect)
    for lo in range(len(kept) + 1):  # a view: offsets need not start at 0
        view = ragged[lo:]
        assert view.nbytes == sum(map(len, kept[lo:])) * 4
        assert view == RaggedRows.from_rows(kept[lo:])
        assert np.array_equal(view.padded(width), rect[lo:])


@pytest.mark.parametrize(
    ("values", "offsets", "message"),
    [
        (np.arange(4), [0, 5], r"within \[0, 4\], found \[0, 5\]"),
        (np.arange(4), [2, 1], "non-decreasing"),
        (np.arange(4), [-1, 2], "non-decreasing"),
        (np.arange(4), np.array([0, 2**64 - 1], np.uint64), "non-decreasing"),
        (np.arange(4), [], "1-D integer row offsets"),
        (np.arange(4), [0.0, 4.0], "1-D integer row offsets"),
        (np.arange(4), [[0, 4]], "1-D integer row offsets"),
        (np.zeros((2, 2)), [0, 4], "1-D values"),
    ],
)
def test_ragged_rows_refuse_hostile_offsets(values, offsets, message):
    with pytest.raises(PackedError, match=message):
        RaggedRows(values, offsets)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_ragged_rows_refuse_hostile_lengths():
    with pytest.raises(PackedError, match="row lengths >= 0, found -1"):
        RaggedRows.from_lengths(np.arange(3), [4, -1])
    with pytest.raises(PackedError):  # wraps to a negative offset: refused, not accepted
        RaggedRows.from_lengths(np.arange(0), np.array([2**64 - 1, 1], np.uint64))
    with pytest.raises(PackedError, match="1-D integer row lengths"):
        RaggedRows.from_lengths(np.arange(3), [1.5, 1.5])
    with pytest.raises(PackedError, match=r"\[rows, width\] integer array"):
        RaggedRows.from_padded(np.zeros((2, 2), bool))


@settings(max_examples=200, deadline=None)
@given(spans_strategy, spans_strategy, st.integers(-2, 12), st.integers(-2, 12))
def test_spans_match_sets_of_positions(a, b, lo, hi):
    merged_a, merged_b = merge(a), merge(b)
    assert positions(merged_a) == positions((s, e) for s, e in a)
    assert_ordered_disjoint(merged_a)
    for (_, end), (start, _) in itertools.pairwise(merged_a):
        assert end < start  # merged: neither overlapping nor touching
    both = intersect(merged_a, merged_b)
    assert positions(both) == positions(merged_a) & positions(merged_b)
    assert_ordered_disjoint(both)
    holes = complement(merged_a, lo, hi)
    assert positions(holes) == set(range(lo, hi)) - positions(merged_a)
    assert_ordered_disjoint(holes)
    assert format_spans(both) == ", ".join(f"[{s}, {e})" for s, e in both)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 6)), max_size=8))
def test_aranges_matches_a_loop(pairs):
    starts = np.array([s for s, _ in pairs], np.int64)
    counts = np.array([n for _, n in pairs], np.int64)
    want = [v for s, n in pairs for v in range(s, s + n)]
    got = aranges(starts, counts)
    assert got.dtype == np.int64
    assert got.tolist() == want


class _Colour(enum.IntEnum):
    RED = 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3),
        (np.int64(3), 3),
        (np.uint64(2**63), 2**63),
        (2**80, 2**80),
        (_Colour.RED, 3),
        (True, None),
        (np.bool_(True), None),
        (3.0, None),
        (np.float64(3), None),
        (torch.tensor(3), None),
        ("3", None),
        (-1, None),
        (None, None),
    ],
)
def test_checked_int_accepts_ints_only(value, expected):
    if expected is None:
        with pytest.raises(PackedError, match="n: expected an int >= 0, found"):
            checked_int("n", value, error=PackedError)
    else:
        got = checked_int("n", value, error=PackedError)
        assert got == expected
        assert type(got) is int
    with pytest.raises(ConfigError, match=r"n: expected an int in \[0, 2\], found 3"):
        checked_int("n", 3, maximum=2)


@pytest.mark.parametrize(
    ("dtype", "good", "bad"),
    [
        (np.dtype(np.uint8), [0, 255, np.uint8(7), 3.0, True], [-1, 256, 0.5, np.nan, "1"]),
        (torch.int16, [-32768, 32767], [32768, float("inf")]),
        (torch.uint64, [2**64 - 1], [2**64, -1]),
        (torch.bool, [0, 1, False, np.bool_(True)], [-1, 2, 0.5]),
        (torch.float16, [0.5, float("nan"), -1], ["0", None, torch.tensor(1.0)]),
        # beyond the largest finite value: torch's RuntimeError, or numpy's silent inf
        (torch.float16, [65504, -65504.0, float("-inf")], [1e10, -70000, 10**400]),
        (torch.bfloat16, [3e38], [1e39]),
        (np.dtype(np.float32), [np.float64(3e38)], [1e39]),
    ],
)
def test_checked_fill_matches_what_the_dtype_holds(dtype, good, bad):
    for value in good:
        assert checked_fill("fill", value, dtype) is value
    for value in bad:
        with pytest.raises(ConfigError, match=r"fill: expected a value .* holds exactly"):
            checked_fill("fill", value, dtype)


@options
class _Knobs:
    depth: int = 1
    name: str = "x"


def test_options_refuse_positional_and_misspelt_names():
    assert _Knobs(depth=2).depth == 2
    with pytest.raises(ConfigError, match=r"options are keywords \(depth, name\), found 1"):
        _Knobs(2)
    with pytest.raises(ConfigError, match=r"unknown option 'dept' \(did you mean 'depth'\?\)"):
        _Knobs(dept=2)
    with pytest.raises(ConfigError, match=r"expected a _Knobs \(or a mapping"):
        as_options(_Knobs, 3, "knobs")
    assert as_options(_Knobs, {"name": "y"}, "knobs") == _Knobs(name="y")
    assert as_options(_Knobs, None, "knobs") == _Knobs()

    @checked_keywords({"old": "new=..."})
    def call(first, *, new=0):
        return first + new

    assert call(1, new=2) == 3
    with pytest.raises(ConfigError, match=r"unknown option 'old' \(now new=\.\.\.\)"):
        call(1, old=2)


def test_checked_keywords_take_positional_parameters_by_name():
    """``loader(samples=..., batch_size=...)`` is a legal call; only keyword-only parameters
    counted as valid, so it was refused: "unknown option 'samples'"."""

    @checked_keywords()
    def call(only, /, first, second=0, *, new=0):
        return only + first + second + new

    assert call(1, first=2, second=3, new=4) == 10
    assert call(1, 2, new=1) == 4
    with pytest.raises(ConfigError, match=r"unknown option 'only'"):
        call(only=1, first=2)  # positional-only: not a keyword
    assert loader(samples=[], batch_size=1) is not None


# --- batches: copies, pickles, iteration ---------------------------------------------------


def _batch() -> TensorBatch:
    routes = PackedTensor.from_lengths(torch.arange(12, dtype=torch.uint8).reshape(6, 2), [2, 0, 4])
    masks = PackedRagged.from_samples(
        [RaggedRows.from_rows([[1, 2]]), RaggedRows.from_rows([]), RaggedRows.from_rows([[], [3]])]
    )
    return TensorBatch(
        {
            "routes": routes,
            "mask": masks,
            "valid": torch.tensor([True, False, True]),
            "id": list("abc"),
        },
        {"index": PerSample([4, 5, 6]), "step": 2},
    )


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_batch_survives_pickle_and_deepcopy(protocol):
    batch = _batch()
    for restored in (pickle.loads(pickle.dumps(batch, protocol=protocol)), copy.deepcopy(batch)):
        assert restored == batch
        assert restored["routes"].values.data_ptr() != batch["routes"].values.data_ptr()
        restored["routes"].values.fill_(0)  # a copy: the batch is untouched
        assert batch["routes"].values.sum() == 66
        assert restored.metadata["index"] == PerSample([4, 5, 6])
    shallow = copy.copy(batch)
    assert shallow["routes"] is batch["routes"]


def test_batch_selection_keeps_every_field_aligned():
    batch = _batch()
    for index, want in [
        ([2, -3, 2], [2, 0, 2]),
        (np.array([False, True, True]), [1, 2]),
        (torch.tensor([1]), [1]),
        ([], []),
        (slice(None, None, -1), [2, 1, 0]),
        (slice(5, 1, None), []),
    ]:
        picked = batch[index]
        assert picked["id"] == [batch["id"][i] for i in want]
        assert picked.metadata["index"] == PerSample(batch.metadata["index"][i] for i in want)
        assert picked["valid"].tolist() == [batch["valid"][i].item() for i in want]
        for j, i in enumerate(want):
            assert torch.equal(picked["routes"][j], batch["routes"][i])
            assert picked["mask"][j] == batch["mask"][i]
    assert batch.to("cpu") == batch
    assert [seg.shape[0] for seg in batch["routes"]] == [2, 0, 4]
    assert [len(rows) for rows in (batch["mask"][i] for i in range(3))] == [1, 0, 2]
    with pytest.raises(PackedIndexError):
        batch["routes"][3]
    with pytest.raises(PackedIndexError):
        batch[[3]]


def test_zero_sample_batches_pad_and_concatenate():
    empty = PackedTensor.empty((2,), torch.int64)
    assert empty.padded(fill=-1, max_len=3).shape == (0, 3, 2)
    assert PackedTensor.from_padded(torch.zeros(0, 3, 2, dtype=torch.int64), []) == empty
    assert empty.cu_seqlens.tolist() == [0]
    assert list(empty) == []
    assert PackedTensor.cat([empty, empty]) == empty
    ragged = PackedRagged.from_samples([], np.int32)
    assert PackedRagged.cat([ragged, ragged]) == ragged
    assert _batch()[[]].batch_size == 0


# --- BufferPool: a live batch never sees its memory reused ---------------------------------

SHAPE = (POOL_MIN_BYTES // 64, 64)


def _keep_view(t):
    return t[5:10]


def _keep_pickled(t):
    buffers = []
    packed = PackedTensor.from_lengths(t, [SHAPE[0]])
    blob = pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(blob, buffers=buffers).values


def _keep_segment(t):
    return TensorBatch({"r": PackedTensor.from_lengths(t, [10, SHAPE[0] - 10])})[1:]["r"][0]


KEEPERS = {
    "view": _keep_view,
    "storage": lambda t: torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()),
    "dlpack": lambda t: torch.from_dlpack(t),
    "numpy dlpack": lambda t: np.from_dlpack(t),
    "numpy": lambda t: t.numpy()[3:],
    "memoryview": lambda t: memoryview(t.numpy()),
    "int32 view": lambda t: t.view(torch.int32)[1:],
    "pickled out of band": _keep_pickled,
    "batch segment": _keep_segment,
}


@pytest.mark.parametrize("keeper", sorted(KEEPERS))
def test_pool_never_reuses_memory_something_still_holds(keeper):
    pool = BufferPool(max_free=4)
    batch = pool.empty(SHAPE, torch.uint8)
    batch.fill_(5)
    address = batch.data_ptr()
    kept = KEEPERS[keeper](batch)
    del batch
    gc.collect()
    again = pool.empty(SHAPE, torch.uint8)
    again.fill_(9)
    assert again.data_ptr() != address
    assert np.all(np.asarray(torch.as_tensor(np.asarray(kept))).view(np.uint8) == 5)
    del kept
    gc.collect()
    assert pool.empty(SHAPE, torch.uint8).data_ptr() == address  # now it is recycled


def test_pool_reuses_by_bytes_across_dtypes_within_twice_the_size():
    pool = BufferPool(max_free=4)
    first = pool.empty((4 * POOL_MIN_BYTES,), torch.uint8)  # a mapping of 4.5 x POOL_MIN_BYTES
    address = first.data_ptr()
    del first
    as_int64 = pool.empty((POOL_MIN_BYTES // 4, 2), torch.int64)  # same bytes, other dtype
    assert as_int64.data_ptr() == address
    assert as_int64.shape == (POOL_MIN_BYTES // 4, 2)
    del as_int64
    bigger = pool.empty((5 * POOL_MIN_BYTES,), torch.uint8)
    assert bigger.data_ptr() != address  # more than the free mapping holds
    smaller = pool.empty((2 * POOL_MIN_BYTES,), torch.bool)
    assert smaller.data_ptr() != address  # less than half of it
    fits = pool.empty((POOL_MIN_BYTES // 2 * 3, 1), torch.int16)  # 3 x POOL_MIN_BYTES
    assert fits.data_ptr() == address


def test_pool_threads_never_share_a_live_buffer():
    pool = BufferPool(max_free=2)
    failures: list[str] = []
    start = threading.Barrier(2)

    def work(tag: int) -> None:
        start.wait()
        for step in range(40):
            buffer = pool.empty((POOL_MIN_BYTES + 4096 * (step % 3),), torch.uint8)
            buffer.fill_(tag)
            threading.Event().wait(0.0005)
            if int(buffer.min()) != tag or int(buffer.max()) != tag:
                failures.append(f"thread {tag} step {step}: another thread wrote its buffer")
            del buffer

    threads = [threading.Thread(target=work, args=(tag,)) for tag in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert pool.nbytes <= 4 * int((POOL_MIN_BYTES + 8192) * pool.slack)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_memory_is_private_to_the_process():
    """Pool mappings were MAP_SHARED: a forked child (a checkpoint writer, a worker) that
    wrote into its copy of a batch, or filled a mapping its copy of the pool took as free,
    wrote into the parent's batch. Shared anonymous memory is also shmem, whose huge pages
    ``madvise`` does not turn on (shmem_enabled is never by default)."""
    pool = BufferPool()
    batch = pool.empty(SHAPE, torch.uint8)
    batch.fill_(5)
    rows = batch.numpy()
    child = os.fork()
    if child == 0:  # the child writes its copy with numpy (torch's threads do not fork)
        rows.fill(7)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(batch.min()) == int(batch.max()) == 5


def test_a_zero_slice_step_is_a_typed_error():
    """``[::0]`` was Python's bare ValueError from ``slice.indices``."""
    packed = PackedTensor.from_lengths(torch.arange(3), [1, 2])
    ragged = RaggedRows.from_rows([[1], [2, 3]])
    for sliced in (packed, TensorBatch({"p": packed}), ragged, PackedRagged.from_samples([ragged])):
        with pytest.raises(PackedIndexError, match="slice step must not be zero"):
            sliced[::0]
