"""The plan executor (``fill_field``): every source kind, placeholders, coalesced reads, short
reads and checksums in the middle of a run, claims checked before allocating, the one screen
on inline and by-handle rows alike, and the buffers it allocates."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pybase64
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from r3data.buffers import POOL_MIN_BYTES, BufferPool, empty_rows
from r3data.errors import (
    PayloadChecksumError,
    PayloadError,
    PayloadReadError,
    SegmentError,
    TraceError,
    TraceGapError,
    with_message,
)
from r3data.nodes import ScreenOptions, fill_field
from r3data.nodes import fill as fill_module
from r3data.payload import PayloadReader, PayloadSegment, PayloadWriter
from r3data.ragged import RaggedRows
from r3data.spans import merge
from r3data.trace import FieldInfo, PlaceholderRows, StitchedField, distinct_row
from r3data.wire import EncodedRows, InlineRows

ROW = (3, 2)  # layers, topk


def field_of(pieces, dtype=np.uint8, row_shape=ROW, ragged=False, topk=None) -> StitchedField:
    n = sum(p.rows for p in pieces)
    info = FieldInfo(np.dtype(dtype), () if ragged else row_shape, ragged)
    return StitchedField("r", tuple(pieces), info, n, topk)


def encoded(array: np.ndarray, pos: int, header: bytes = b"") -> EncodedRows:
    """Rows as a producer sends them: base64 of (optional header bytes +) the array."""
    data = pybase64.b64encode(header + array.tobytes())
    return EncodedRows(
        "r",
        memoryview(data),
        dtype=array.dtype,
        row_shape=array.shape[1:],
        rows=array.shape[0],
        pos=pos,
        skip=len(header),
    )


def engine(rng: np.random.Generator, rows: int, dtype=np.uint8) -> np.ndarray:
    """Rows a router would pick: distinct experts 1..9, never all zero."""
    return (np.argsort(rng.random((rows, *ROW[:1], 9)), -1)[..., : ROW[1]] + 1).astype(dtype)


KINDS = ("inline", "encoded", "npy", "handle", "gap")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(KINDS), st.integers(1, 5)), max_size=5), max_size=4
    ),
    st.sampled_from(["repeat_previous", "distinct"]),
    st.integers(1, 3),
)
def test_every_source_kind_fills_its_rows_exactly(tmp_path_factory, plan, kind, workers):
    """Samples of inline, base64 (with and without a .npy-style header), by-handle pieces and
    placeholders fill exactly what a naive reference writes; valid marks the engine rows."""
    rng = np.random.default_rng(len(plan))
    root = tmp_path_factory.mktemp("fill")
    writer = PayloadWriter(root)
    fields, want_rows, want_valid = [], [], []
    for sample in plan:
        pieces, rows, valid, pos, previous = [], [], [], 0, None
        for source, n in sample:
            array = engine(rng, n)
            if source == "gap":
                if kind == "repeat_previous" and previous is not None:
                    one = previous.clipped(previous.end - 1, previous.end)
                    pieces.append(PlaceholderRows("r", pos, n, kind, one))
                    rows.append(np.broadcast_to(rows[-1][-1], (n, *ROW)))
                else:
                    pieces.append(PlaceholderRows("r", pos, n, "distinct"))
                    distinct = distinct_row(ROW, np.dtype(np.uint8))
                    rows.append(np.broadcast_to(distinct, (n, *ROW)))
                valid.append(np.zeros(n, bool))
            else:
                if source == "inline":
                    piece = InlineRows("r", array, pos)
                elif source == "encoded":
                    piece = encoded(array, pos)
                elif source == "npy":
                    piece = encoded(array, pos, header=b"\x93NUMPY" + bytes(rng.integers(0, 9, 5)))
                else:
                    (piece,) = writer.write(0, {"r": array}, pos=pos)
                pieces.append(piece)
                previous = piece
                rows.append(array)
                valid.append(np.ones(n, bool))
            pos += n
        fields.append(field_of(pieces))
        want_rows.append(np.concatenate(rows) if rows else np.zeros((0, *ROW), np.uint8))
        want_valid.append(np.concatenate(valid) if valid else np.zeros(0, bool))
    filled = fill_field(
        "r",
        fields,
        dtype=np.dtype(np.uint8),
        reader=PayloadReader(root),
        screen=ScreenOptions(num_experts=10),
        workers=workers,
    )
    assert list(filled.values.lengths) == [len(w) for w in want_rows]
    for got, want in zip(filled.values, want_rows, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(
        filled.valid, np.concatenate(want_valid) if want_valid else np.zeros(0, bool)
    )


def test_turns_of_other_dtypes_widen_and_narrow_only_once_screened(tmp_path):
    rng = np.random.default_rng(1)
    narrow, wide = engine(rng, 4), engine(rng, 3, np.uint16)
    (by_handle,) = PayloadWriter(tmp_path).write(0, {"r": wide}, pos=4)
    pieces = [InlineRows("r", narrow, 0), by_handle, encoded(wide.astype(np.int32), 7)]
    reader = PayloadReader(tmp_path)
    widened = fill_field("r", [field_of(pieces)], dtype=np.dtype(np.int32), reader=reader)
    np.testing.assert_array_equal(widened.values.values[4:7].numpy(), wide)
    compact = fill_field(
        "r",
        [field_of(pieces)],
        dtype=np.dtype(np.uint8),
        reader=reader,
        screen=ScreenOptions(num_experts=16),
    )
    np.testing.assert_array_equal(compact.values.values[7:].numpy(), wide)
    too_wide = wide.astype(np.int32)
    too_wide[1, 2, 0] = 300  # would wrap to 44 in uint8: refused before any narrowing
    with pytest.raises(TraceError, match=r"\[0, 256\), found 300 at position 1 \(layer 2\)"):
        fill_field(
            "r",
            [field_of([InlineRows("r", too_wide, 0)])],
            dtype=np.dtype(np.uint8),
            screen=ScreenOptions(num_experts=256),
        )
    with pytest.raises(SegmentError, match="found uint16"):  # no narrowing without num_experts
        fill_field("r", [field_of([InlineRows("r", wide, 0)])], dtype=np.dtype(np.uint8))


def test_adjacent_segments_of_a_file_are_read_in_one_system_call(tmp_path, monkeypatch):
    """Four requests' rows in one file, back to back: one preadv fills them all, straight into
    the four samples' slices (not adjacent in the batch: another sample sits between)."""
    rng = np.random.default_rng(2)
    parts = [engine(rng, n) for n in (5, 3, 7, 2)]
    (whole,) = PayloadWriter(tmp_path).write(0, {"r": np.concatenate(parts)})
    segments, pos = [], 0
    for part in parts:
        segments.append(whole.clipped(pos, pos + len(part)))
        pos += len(part)
    fields = [field_of([s]) for s in segments[:2]]
    fields.insert(1, field_of([InlineRows("r", engine(rng, 4), 0)]))
    fields += [field_of(segments[2:])]
    calls = []
    real = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, bufs, at: calls.append(len(bufs)) or real(fd, bufs, at)
    )
    filled = fill_field("r", fields, dtype=np.dtype(np.uint8), reader=PayloadReader(tmp_path))
    assert calls == [4]  # one call, four destinations
    wants = [parts[0], None, parts[1], np.concatenate(parts[2:])]
    for got, want in zip(filled.values, wants, strict=True):
        if want is not None:
            np.testing.assert_array_equal(got.numpy(), want)


def test_a_short_read_in_the_middle_of_a_coalesced_run_names_the_range(tmp_path):
    rng = np.random.default_rng(3)
    parts = [engine(rng, n) for n in (5, 6, 4)]
    (whole,) = PayloadWriter(tmp_path).write(0, {"r": np.concatenate(parts)})
    segments = [whole.clipped(0, 5), whole.clipped(5, 11), whole.clipped(11, 15)]
    path = tmp_path / whole.file
    keep = segments[1].offset + 13  # in the middle of the second range
    path.write_bytes(path.read_bytes()[:keep])
    reader = PayloadReader(tmp_path, retries=1, backoff=0.001)
    with pytest.raises(SegmentError, match=r"claims bytes up to \d+, but the file has \d+ bytes"):
        fill_field("r", [field_of(segments)], dtype=np.dtype(np.uint8), reader=reader)
    # read straight into caller buffers (no claim check), the run stops at the exact byte
    out = np.zeros((15, *ROW), np.uint8)
    with pytest.raises(
        PayloadReadError,
        match=rf"wanted {segments[1].nbytes} bytes at offset {segments[1].offset}, got 13 after 2",
    ):
        reader.read_into(segments, out)
    np.testing.assert_array_equal(out[:5], parts[0])  # what was read is in place


def test_a_checksum_mismatch_names_the_file_and_rows_in_a_run(tmp_path):
    rng = np.random.default_rng(4)
    writer = PayloadWriter(tmp_path)
    segments = [writer.write(0, {"r": engine(rng, 4)})[0] for _ in range(3)]
    bad = segments[1]
    with open(tmp_path / bad.file, "r+b") as f:
        f.seek(bad.offset + 7)
        byte = f.read(1)
        f.seek(bad.offset + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    fields = [field_of([s]) for s in segments]
    with pytest.raises(
        PayloadChecksumError, match=rf"{bad.file}: field 'r' rows \[0, 4\) at offset {bad.offset}"
    ) as info:
        fill_field("r", fields, dtype=np.dtype(np.uint8), reader=PayloadReader(tmp_path))
    assert "rows [0, 4)" in str(info.value)


def _source(kind: str, rows: np.ndarray, tmp_path) -> InlineRows | EncodedRows | PayloadSegment:
    if kind == "inline":
        return InlineRows("r", rows, 0)
    if kind == "encoded":
        return encoded(rows, 0)
    (segment,) = PayloadWriter(tmp_path).write(0, {"r": rows})
    return segment


@pytest.mark.parametrize("kind", ["inline", "encoded", "handle"])
@pytest.mark.parametrize("rows", [6, 40_000])  # small pieces screened together, large as they land
def test_one_screen_for_every_source_kind(tmp_path, kind, rows):
    rng = np.random.default_rng(5)
    good = engine(rng, rows, np.int16)
    at = rows - 3  # a large piece: in its last chunk
    zero, no_route, too_big = good.copy(), good.copy(), good.copy()
    zero[at] = 0
    no_route[at, 1, 0] = -1
    too_big[at, 2, 1] = 12

    def run(rows, **screen):
        last = PlaceholderRows("r", len(rows), 1, "distinct")  # the never-forwarded token
        return fill_field(
            "r",
            [field_of([_source(kind, rows, tmp_path), last], np.int16)],
            dtype=np.dtype(np.int16),
            reader=PayloadReader(tmp_path),
            screen=ScreenOptions(num_experts=10, **screen),
        )

    assert run(good).valid[:rows].all()
    for bad in (zero, no_route):  # missing rows: a gap, the sample's routes dropped
        filled = run(bad)
        assert not filled.valid.any()
        assert (filled.values.values.numpy() == np.arange(2)).all()
        assert (filled.stats.gaps, filled.stats.rows_missing) == (1, 1)
        assert any(f"[{at}, {at + 1})" in w for w in filled.warnings)
    with pytest.raises(TraceError, match=rf"positions \[{at}\] are zero in every layer"):
        run(zero, zero_rows="raise")
    kept = run(zero, zero_rows="keep")
    assert kept.valid[:rows].all()
    assert not kept.values.values[at].any()
    with pytest.raises(TraceError, match=rf"\[0, 10\), found 12 at position {at} \(layer 2\)"):
        run(too_big)
    field = field_of([_source(kind, zero, tmp_path)], np.int16)
    options = {"dtype": np.dtype(np.int16), "reader": PayloadReader(tmp_path)}
    assert fill_field(
        "r", [field], on_gap="drop_sample", **options, screen=ScreenOptions()
    ).dropped == [0]
    with pytest.raises(TraceGapError, match=rf"1 route rows at positions \[{at}, {at + 1}\)"):
        fill_field("r", [field], on_gap="raise", **options, screen=ScreenOptions())


def test_a_repeated_row_that_is_missing_becomes_distinct_not_a_gap():
    """On a rank whose share starts with a placeholder, the row it repeats is read from its
    source; a row the screen refuses is never repeated, and is no gap of this rank's."""
    rows = engine(np.random.default_rng(6), 4)
    rows[-1] = 0
    source = InlineRows("r", rows, 0).clipped(3, 4)
    local = [PlaceholderRows("r", 4, 3, "repeat_previous", source), InlineRows("r", rows[:1], 7)]
    filled = fill_field("r", [field_of(local)], dtype=np.dtype(np.uint8), screen=ScreenOptions())
    assert filled.valid.tolist() == [False] * 3 + [True]
    assert (filled.values.values[:3].numpy() == distinct_row(ROW, np.dtype(np.uint8))).all()
    assert filled.stats.gaps == 0
    good = InlineRows("r", engine(np.random.default_rng(7), 4), 0)
    local[0] = PlaceholderRows("r", 4, 3, "repeat_previous", good.clipped(3, 4))
    filled = fill_field("r", [field_of(local)], dtype=np.dtype(np.uint8), screen=ScreenOptions())
    assert (filled.values.values[:3].numpy() == good.array[3]).all()


def test_claims_are_checked_before_anything_is_allocated(tmp_path):
    (real,) = PayloadWriter(tmp_path).write(0, {"r": engine(np.random.default_rng(7), 3)})
    huge = PayloadSegment("r", real.file, real.offset, 0, 2**20, "uint8", (2**14,))
    tracemalloc.start()
    try:
        with pytest.raises(SegmentError, match=r"claims bytes up to \d+, but the file has"):
            fill_field(
                "r",
                [field_of([huge], row_shape=(2**14,))],
                dtype=np.dtype(np.uint8),
                reader=PayloadReader(tmp_path, retries=0),
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    absurd = PayloadSegment("r", real.file, real.offset, 0, 1, "uint8", (2**62,))
    with pytest.raises(SegmentError):
        fill_field(
            "r",
            [field_of([absurd], row_shape=(2**62,))],
            dtype=np.dtype(np.uint8),
            reader=PayloadReader(tmp_path, retries=0),
        )


def test_ragged_rows_from_every_source_into_one_csr_buffer(tmp_path):
    rng = np.random.default_rng(8)
    sets = [rng.choice(50, int(w), replace=False).astype(np.int32) for w in (2, 0, 5, 1, 3, 4)]
    writer = PayloadWriter(tmp_path)
    (ragged,) = writer.write(0, {"r": sets[2:4]}, pos=3)
    padded = np.full((2, 4), -1, np.int32)
    for i, row in enumerate(sets[4:]):
        padded[i, : len(row)] = row
    (fixed,) = writer.write(0, {"r": padded}, pos=5)  # prime-rl: padded with -1 by handle
    pieces = [
        PlaceholderRows("r", 0, 1, "fill"),
        InlineRows("r", RaggedRows.from_rows(sets[:2]), 1),
        ragged,
        fixed,
    ]
    filled = fill_field(
        "r",
        [field_of(pieces, np.int32, ragged=True)],
        dtype=np.dtype(np.int32),
        reader=PayloadReader(tmp_path),
    )
    rows = filled.values.segment(0)
    assert rows.lengths.tolist() == [0, *[len(s) for s in sets]]
    for i, want in enumerate(sets, 1):
        np.testing.assert_array_equal(rows[i : i + 1].compact()[0], want)
    # a row with no ids (the empty set above) is no mask there: not valid
    assert filled.valid.tolist() == [False, True, False] + [True] * 4
    assert filled.values.values.numel() == sum(len(s) for s in sets)  # every id once


def test_padded_inline_rows_in_a_ragged_field_are_refused_typed():
    """The trace builder makes padded inline rows of a ragged field ragged; a hand-made
    stitched field holding padded ones is refused by the fill, not misread."""
    pieces = [InlineRows("r", np.array([[1, -1], [2, 3]], np.int32), 0)]
    with pytest.raises(SegmentError, match=r"expected ragged rows, found rows of shape \[2, 2\]"):
        fill_field("r", [field_of(pieces, np.int32, ragged=True)], dtype=np.dtype(np.int32))


def test_fill_refuses_wrong_shapes_and_missing_reader(tmp_path):
    rows = np.zeros((2, 2, 3), np.uint8)
    with pytest.raises(SegmentError, match=r"expected rows of shape \(2, 4\), found \(2, 3\)"):
        fill_field(
            "r", [field_of([InlineRows("r", rows, 0)], row_shape=(2, 4))], dtype=np.dtype(np.uint8)
        )
    (segment,) = PayloadWriter(tmp_path).write(0, {"r": rows})
    with pytest.raises(SegmentError, match="needs a payload reader") as info:
        fill_field(
            "r",
            [
                field_of([InlineRows("r", rows, 0)], row_shape=(2, 3)),
                field_of([segment], row_shape=(2, 3)),
            ],
            dtype=np.dtype(np.uint8),
        )
    assert info.value.r3data_sample == 1


def test_no_temporary_of_a_blob_is_made_while_decoding_into_place():
    """A 32 MiB base64 blob decodes into its slice through a bounce of about 1 MiB."""
    rows = np.random.default_rng(9).integers(1, 9, (1 << 19, 32, 2), dtype=np.uint8)
    source = encoded(rows, 0)
    field = field_of([source], row_shape=(32, 2))
    out = empty_rows((rows.shape[0], 32, 2), torch.uint8)
    out.numpy().fill(1)  # faulted in, as a recycled batch buffer is
    tracemalloc.start()
    try:
        filled = fill_field("r", [field], dtype=np.dtype(np.uint8), workers=1, pool=_Handing(out))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(filled.values.values.numpy(), rows)
    assert peak < 4 << 20  # nothing near the 32 MiB of the rows


class _Handing(BufferPool):
    """A pool that hands out one prepared buffer (to measure the fill alone)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor

    def empty(self, shape, dtype):
        assert tuple(shape) == tuple(self.tensor.shape)
        return self.tensor


@pytest.mark.parametrize("nbytes", [16, POOL_MIN_BYTES * 2])
def test_pool_buffers_are_writable_tensors_of_the_asked_shape(nbytes):
    rows = nbytes // (8 * 2)
    tensor = empty_rows((rows, 8), torch.uint16, pool=BufferPool())
    assert tensor.shape == (rows, 8)
    assert tensor.dtype == torch.uint16
    tensor.view(torch.int16).fill_(7)
    assert int(tensor.view(torch.int16).sum()) == 7 * rows * 8
    assert empty_rows((0, 3), torch.int32).shape == (0, 3)


def test_pool_recycles_a_buffer_only_once_nothing_uses_it():
    pool = BufferPool(max_free=1)
    shape = (POOL_MIN_BYTES // 64, 64)
    first = pool.empty(shape, torch.uint8)
    address = first.data_ptr()
    first.fill_(5)
    view = first[3:9].numpy()
    del first
    second = pool.empty(shape, torch.uint8)
    assert second.data_ptr() != address  # a numpy view of the first batch is still alive
    assert int(view.sum()) == 5 * view.size  # and untouched
    del view
    third = pool.empty(shape, torch.uint8)
    assert third.data_ptr() == address  # recycled: no new mapping, no page faults
    assert pool.empty((shape[0] // 4, 64), torch.uint8).data_ptr() not in (
        address,
        second.data_ptr(),
    )
    mapped = pool.nbytes
    del second, third
    pool.empty((shape[0] * 3, 64), torch.uint8)  # too big for the free ones: new, and trim
    assert pool.nbytes <= mapped + 3 * POOL_MIN_BYTES * 1.2


def test_with_message_keeps_the_class_and_chains():
    original = PayloadError("file v1/a.bin: 3 bytes short")
    wrapped = with_message(original, "sample 'x': file v1/a.bin: 3 bytes short")
    assert type(wrapped) is PayloadError
    assert str(wrapped) == "sample 'x': file v1/a.bin: 3 bytes short"
    assert wrapped.__cause__ is original
    other = KeyError("k")
    assert with_message(other, "sample 'y': 'k'") is other
    assert other.__notes__ == ["sample 'y': 'k'"]
    stop = SystemExit(3)
    assert with_message(stop, "sample 'z'") is stop
    assert stop.code == 3


def test_buffer_claims_above_the_bound_are_refused_unallocated():
    field = field_of(
        [PlaceholderRows("r", 0, fill_module.MAX_BUFFER_BYTES, "fill")], row_shape=(2,)
    )
    with pytest.raises(SegmentError, match=r"more than the \d+ any batch buffer may"):
        fill_field("r", [field], dtype=np.dtype(np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(1, 90)), max_size=30))
@example([(0, 10), (74, 1), (140, 5)])  # holes of 64 rows (joined) and 65 (not)
@example([(0, 50), (10, 5), (70, 3)])  # a span inside another: the hole counts from the outer
def test_small_pieces_are_screened_in_joined_runs_of_their_rows(spans):
    """The runs the small pieces are screened in: their rows merged, then joined across holes of
    at most 64 rows (a loop over the merged spans is the model)."""
    spans = sorted((lo, lo + n) for lo, n in spans)
    want: list[tuple[int, int]] = []
    for lo, hi in merge(spans):
        if want and lo - want[-1][1] <= 64:
            want[-1] = (want[-1][0], hi)
        else:
            want.append((lo, hi))
    starts = np.array([lo for lo, _ in spans], np.int64)
    stops = np.array([hi for _, hi in spans], np.int64)
    assert fill_module._joined(starts, stops) == want
