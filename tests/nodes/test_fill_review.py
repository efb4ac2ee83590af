"""The fill against an obviously correct reference: every source kind, placeholder kind, dtype,
screen policy and gap policy, pieces sharing one payload file in any order (coalesced runs,
repeated ranges), written into buffers left dirty by an earlier batch; and failures in the
middle of a coalesced run naming the sample they happened in."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pybase64
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.buffers import POOL_MIN_BYTES, BufferPool
from r3data.errors import (
    PayloadChecksumError,
    PayloadReadError,
    SegmentError,
    TraceError,
    TraceGapError,
)
from r3data.nodes import ScreenOptions, fill_field
from r3data.nodes import fill as fill_module
from r3data.payload import PayloadReader, PayloadWriter
from r3data.payload.fileformat import checksum
from r3data.trace import FieldInfo, PlaceholderRows, StitchedField, distinct_row
from r3data.wire import EncodedRows, InlineRows
from r3data.wire.segment import INDEX_DTYPE

EXPERTS = 12
GEOMETRIES = [(1, 1), (1, 2), (2, 1), (3, 2), (2, 3), (16, 4)]  # (layers, topk)
ANOMALIES = ("none", "zero", "negative", "one_byte", "one_byte", "too_large", "expert_zero")
SOURCES = ("inline", "encoded", "handle", "repeat", "distinct", "fill", "foreign", "again")
"""Piece kinds: three engine sources; placeholders repeating the row before them, distinct or
zero; a placeholder whose source row is not the row before it (a rank-local cut); and a
by-handle piece naming bytes another piece of the batch names too."""


class DirtyPool(BufferPool):
    """A pool whose buffers are full of a previous batch's bytes (every byte ``0xA5``)."""

    def empty(self, shape, dtype):
        tensor = torch.empty(tuple(shape), dtype=dtype)
        tensor.numpy().reshape(-1).view(np.uint8)[:] = 0xA5
        return tensor


def field_of(pieces, dtype, row_shape) -> StitchedField:
    n = sum(p.rows for p in pieces)
    return StitchedField("r", tuple(pieces), FieldInfo(np.dtype(dtype), row_shape, False), n)


def encoded(array: np.ndarray, pos: int) -> EncodedRows:
    data = pybase64.b64encode(array.tobytes())
    return EncodedRows(
        "r",
        memoryview(data),
        dtype=array.dtype,
        row_shape=array.shape[1:],
        rows=len(array),
        pos=pos,
    )


def engine_rows(rng, n, row_shape, dtype, anomaly) -> np.ndarray:
    """Rows a router picks (distinct experts of ``1..EXPERTS-1`` per layer), one of them
    changed as ``anomaly`` says."""
    layers, topk = row_shape
    picks = np.argsort(rng.random((n, layers, EXPERTS - 1)), -1)[..., :topk] + 1
    rows = picks.astype(dtype)
    at, layer, k = rng.integers(n), rng.integers(layers), rng.integers(topk)
    if anomaly == "zero":
        rows[at] = 0
    elif anomaly == "negative" and np.dtype(dtype).kind == "i":
        rows[at, layer, k] = -1
    elif anomaly == "one_byte":  # zero but one byte, anywhere (not only in the probed word)
        rows[at] = 0
        raw = rows[at].reshape(-1).view(np.uint8)
        raw[rng.integers(raw.size)] = rng.integers(1, EXPERTS)  # an id, or a high byte
    elif anomaly == "too_large":
        rows[at, layer, k] = rng.integers(EXPERTS, min(np.iinfo(dtype).max, 300) + 1)
    elif anomaly == "expert_zero":  # expert 0 is a real expert: zero in one entry only
        rows[at, layer] = np.arange(topk)
    return rows


class Reference:
    """What a batch must hold, placed row by row with numpy: each piece's rows decoded whole,
    each row screened whole."""

    def __init__(self, dtype, row_shape, screen: ScreenOptions) -> None:
        self.dtype, self.row_shape, self.screen = np.dtype(dtype), row_shape, screen
        self.distinct = distinct_row(row_shape, self.dtype)

    def too_large(self, rows: np.ndarray) -> bool:
        limit = self.screen.num_experts
        return limit is not None and bool((rows.astype(np.int64) >= limit).any())

    def missing(self, rows: np.ndarray) -> np.ndarray:
        flat = rows.reshape(len(rows), -1).astype(np.int64)
        zero = (flat == 0).all(axis=1) & (self.screen.zero_rows != "keep")
        return zero | (flat < 0).any(axis=1)

    def refused(self, rows: np.ndarray) -> bool:
        """Whether the screen refuses ``rows`` (an id out of range, or a zero row under
        ``zero_rows="raise"``)."""
        zero = (rows.reshape(len(rows), -1) == 0).all(axis=1).any()
        return self.too_large(rows) or (self.screen.zero_rows == "raise" and bool(zero))


def build_batch(draw, tmp_path):
    """A random batch: its plans, its expected rows/valid/gaps/refusals, and its options."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row_shape = draw(st.sampled_from(GEOMETRIES))
    dtype = np.dtype(draw(st.sampled_from([np.uint8, np.int16, np.int32])))
    experts = draw(st.sampled_from([None, EXPERTS]))
    screen = ScreenOptions(
        num_experts=experts, zero_rows=draw(st.sampled_from(["missing", "raise", "keep"]))
    )
    # another dtype a turn may arrive in: widened, or narrowed once screened against experts
    other = np.dtype(np.uint8) if dtype != np.uint8 else (np.dtype(np.int16) if experts else None)
    ref = Reference(dtype, row_shape, screen)
    plans = draw(
        st.lists(
            st.lists(
                st.tuples(
                    st.sampled_from(SOURCES),
                    st.integers(1, 6),
                    st.sampled_from(ANOMALIES),
                    st.booleans(),  # in the other dtype
                    st.integers(0, 9),  # 0: a large piece (screened as it lands)
                ),
                max_size=5,
            ),
            min_size=1,
            max_size=4,
        )
    )
    row_bytes = dtype.itemsize * row_shape[0] * row_shape[1]
    files: dict[np.dtype, list] = {}  # by-handle rows to write, by dtype: (rows, fill-in)
    samples = []  # per sample: list of pieces (a by-handle piece: an index into `files`)
    want = []  # per sample: expected rows, valid, missing (real rows), refused
    for plan in plans:
        pieces, rows, valid, missing, refused = [], [], [], [], False
        previous = None  # (piece, its rows) of the last engine piece
        for kind, n, anomaly, in_other, size in plan:
            piece_dtype = other if in_other and other is not None else dtype
            if size == 0 and row_bytes >= 32:
                n = fill_module._SMALL // row_bytes + n
            pos = sum(len(r) for r in rows)
            if kind in ("inline", "encoded", "handle") or (kind == "again" and not files):
                array = engine_rows(rng, n, row_shape, piece_dtype, anomaly)
                if kind == "inline":
                    piece = InlineRows("r", array, pos)
                elif kind == "encoded":
                    piece = encoded(array, pos)
                else:
                    files.setdefault(array.dtype, []).append(array)
                    piece = ("handle", array.dtype, len(files[array.dtype]) - 1, pos)
                pieces.append(piece)
                previous = (piece, array)
                refused |= ref.refused(array)
                rows.append(array.astype(dtype, casting="unsafe"))
                valid.append(np.ones(n, bool))
                missing.append(ref.missing(array))
            elif kind == "again":  # bytes another piece of the batch reads too
                key = list(files)[rng.integers(len(files))]
                index = int(rng.integers(len(files[key])))
                array = files[key][index]
                piece = ("handle", key, index, pos)
                pieces.append(piece)
                previous = (piece, array)
                refused |= ref.refused(array)
                rows.append(array.astype(dtype, casting="unsafe"))
                valid.append(np.ones(len(array), bool))
                missing.append(ref.missing(array))
            else:
                source_row = None
                if kind == "repeat" and previous is not None:
                    source_row, source_piece = previous[1][-1:], previous[0]
                elif kind == "foreign":  # a row of a piece that is not in this sample's plan
                    source_row = engine_rows(rng, 1, row_shape, piece_dtype, anomaly)
                    source_piece = InlineRows("r", source_row, 1000)
                if source_row is None:
                    placeholder = "fill" if kind == "fill" else "distinct"
                    pieces.append(PlaceholderRows("r", pos, n, placeholder))
                    row = np.zeros(row_shape, dtype) if kind == "fill" else ref.distinct
                else:
                    pieces.append(("repeat", pos, n, source_piece))
                    refused |= ref.refused(source_row)
                    row = ref.distinct if ref.missing(source_row)[0] else source_row[0]
                    row = row.astype(dtype, casting="unsafe")
                rows.append(np.broadcast_to(row, (n, *row_shape)))
                valid.append(np.zeros(n, bool))
                missing.append(np.zeros(n, bool))
        empty = np.zeros((0, *row_shape), dtype)
        want.append(
            (
                np.concatenate(rows) if rows else empty,
                np.concatenate(valid) if valid else np.zeros(0, bool),
                np.concatenate(missing) if missing else np.zeros(0, bool),
                refused,
            )
        )
        samples.append(pieces)
    # every by-handle array of a dtype in one file, in a shuffled order: the batch's reads of
    # it are out of order, adjacent (coalesced into runs) and repeated
    segments: dict[tuple, object] = {}
    writer = PayloadWriter(tmp_path)
    for key, arrays in files.items():
        order = rng.permutation(len(arrays))
        (whole,) = writer.write(0, {"r": np.concatenate([arrays[i] for i in order])})
        cursor = 0
        for i in order:
            part = whole.clipped(cursor, cursor + len(arrays[i]))
            crc = checksum(arrays[i].tobytes()) if rng.random() < 0.7 else None
            segments[key, int(i)] = replace(part, crc32c=crc)
            cursor += len(arrays[i])

    def resolved(piece, pos=None):
        if type(piece) is tuple and piece[0] == "handle":
            _, key, index, at = piece
            return replace(segments[key, index], pos=at if pos is None else pos)
        return piece

    fields = []
    for pieces in samples:
        done = []
        for piece in pieces:
            if type(piece) is tuple and piece[0] == "repeat":
                _, pos, n, source = piece
                source = resolved(source)
                one = source.clipped(source.end - 1, source.end)
                done.append(PlaceholderRows("r", pos, n, "repeat_previous", one))
            else:
                done.append(resolved(piece))
        fields.append(field_of(done, dtype, row_shape))
    return fields, want, dtype, screen


def check_against_reference(fields, want, dtype, screen, on_gap, workers, pool, root):
    refused = {i for i, w in enumerate(want) if w[3]}
    gaps = sorted(i for i, w in enumerate(want) if w[2].any())
    run = {
        "dtype": dtype,
        "reader": PayloadReader(root),
        "screen": screen,
        "on_gap": on_gap,
        "workers": workers,
        "pool": pool,
    }
    if refused:
        with pytest.raises(TraceError) as info:
            fill_field("r", fields, **run)
        assert not isinstance(info.value, TraceGapError)
        assert info.value.r3data_sample in refused  # the sample it happened in
        return
    if gaps and on_gap == "raise":
        with pytest.raises(TraceGapError) as info:
            fill_field("r", fields, **run)
        assert info.value.r3data_sample in gaps
        return
    filled = fill_field("r", fields, **run)
    assert filled.dropped == (gaps if on_gap == "drop_sample" else [])
    assert list(filled.values.lengths) == [len(w[0]) for w in want]
    for i, (got, (rows, valid, _, _)) in enumerate(zip(filled.values, want, strict=True)):
        lo = int(filled.values.offsets[i])
        got_valid = filled.valid[lo : lo + len(rows)]
        if i in gaps and on_gap == "drop_sample":
            continue  # the collate drops it
        if i in gaps:  # drop_routes: every row a distinct placeholder
            assert not got_valid.any()
            assert (got.numpy() == distinct_row(rows.shape[1:], dtype)).all()
            continue
        np.testing.assert_array_equal(got.numpy(), rows, err_msg=f"sample {i}")
        np.testing.assert_array_equal(got_valid, valid, err_msg=f"sample {i}")


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from(["drop_routes", "drop_sample", "raise"]), st.integers(1, 3))
def test_the_fill_matches_a_naive_reference_in_dirty_buffers(
    tmp_path_factory, data, on_gap, workers
):
    root = tmp_path_factory.mktemp("review")
    fields, want, dtype, screen = build_batch(data.draw, root)
    check_against_reference(fields, want, dtype, screen, on_gap, workers, DirtyPool(), root)


def test_a_recycled_buffer_of_another_shape_keeps_nothing_of_its_last_batch(tmp_path):
    """Two batches of different shapes through one real pool: the second gets the first's
    mapping (its bytes garbage now), and holds exactly its own rows and placeholders."""
    rng = np.random.default_rng(11)
    row_shape = (48, 8)
    pool = BufferPool(max_free=1)
    writer = PayloadWriter(tmp_path)
    rows_first = POOL_MIN_BYTES // 384 + 50
    first = engine_rows(rng, rows_first, row_shape, np.uint8, "none")
    (segment,) = writer.write(0, {"r": first})
    batch = fill_field(
        "r",
        [field_of([segment], np.uint8, row_shape)],
        dtype=np.dtype(np.uint8),
        reader=PayloadReader(tmp_path),
        pool=pool,
    )
    address = batch.values.values.data_ptr()
    batch.values.values.fill_(0xFF)  # the trainer scribbled on it, then dropped it
    del batch
    n = rows_first - 40  # smaller, still within the recycled mapping
    second = engine_rows(rng, n - 30, row_shape, np.uint8, "none")
    (segment,) = writer.write(0, {"r": second})
    pieces = [
        PlaceholderRows("r", 0, 5, "distinct"),
        replace(segment, pos=5),
        PlaceholderRows("r", n - 25, 20, "repeat_previous", segment.clipped(n - 31, n - 30)),
        PlaceholderRows("r", n - 5, 5, "fill"),
    ]
    batch = fill_field(
        "r",
        [field_of(pieces, np.uint8, row_shape)],
        dtype=np.dtype(np.uint8),
        reader=PayloadReader(tmp_path),
        pool=pool,
    )
    assert batch.values.values.data_ptr() == address  # the recycled mapping
    got = batch.values.values.numpy()
    np.testing.assert_array_equal(
        got[:5], np.broadcast_to(distinct_row(row_shape, np.uint8), (5, *row_shape))
    )
    np.testing.assert_array_equal(got[5 : n - 25], second)
    np.testing.assert_array_equal(
        got[n - 25 : n - 5], np.broadcast_to(second[-1], (20, *row_shape))
    )
    assert not got[n - 5 :].any()
    assert batch.valid.tolist() == [False] * 5 + [True] * (n - 30) + [False] * 25


# --- failures in the middle of a coalesced run name the sample they happened in -------------


def _one_file(tmp_path, arrays, crc=True):
    """``arrays`` back to back in one file; one segment each (pos 0: one sample each)."""
    (whole,) = PayloadWriter(tmp_path).write(0, {"r": np.concatenate(arrays)})
    segments, cursor = [], 0
    for array in arrays:
        part = whole.clipped(cursor, cursor + len(array))
        segments.append(replace(part, pos=0, crc32c=checksum(array.tobytes()) if crc else None))
        cursor += len(array)
    return segments


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_checksum_mismatch_in_a_run_names_its_own_sample(tmp_path, bad):
    rng = np.random.default_rng(bad)
    arrays = [engine_rows(rng, 5, (3, 2), np.uint8, "none") for _ in range(3)]
    segments = _one_file(tmp_path, arrays)
    segments[bad] = replace(segments[bad], crc32c=segments[bad].crc32c ^ 1)
    fields = [field_of([s], np.uint8, (3, 2)) for s in segments]
    with pytest.raises(
        PayloadChecksumError,
        match=rf"{segments[bad].file}: field 'r' .* at offset "
        rf"{segments[bad].offset}",
    ) as info:
        fill_field("r", fields, dtype=np.dtype(np.uint8), reader=PayloadReader(tmp_path))
    assert info.value.r3data_sample == bad


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_an_id_out_of_range_in_a_run_names_its_own_sample(tmp_path, bad):
    """Large pieces are screened as their bytes land, in the middle of the file's run."""
    rng = np.random.default_rng(bad)
    n = fill_module._SMALL // 6 + 10
    arrays = [engine_rows(rng, n, (3, 2), np.uint8, "none") for _ in range(3)]
    arrays[bad][n // 2, 1, 1] = 200
    segments = _one_file(tmp_path, arrays, crc=False)
    fields = [field_of([s], np.uint8, (3, 2)) for s in segments]
    with pytest.raises(TraceError, match=rf"found 200 at position {n // 2} \(layer 1\)") as info:
        fill_field(
            "r",
            fields,
            dtype=np.dtype(np.uint8),
            reader=PayloadReader(tmp_path),
            screen=ScreenOptions(num_experts=EXPERTS),
            workers=1,
        )
    assert info.value.r3data_sample == bad


def test_a_file_cut_short_after_the_sizes_check_names_the_sample_that_needed_it(tmp_path):
    rng = np.random.default_rng(5)
    arrays = [engine_rows(rng, 5, (3, 2), np.uint8, "none") for _ in range(3)]
    segments = _one_file(tmp_path, arrays)
    path = tmp_path / segments[0].file
    real = PayloadReader(tmp_path, retries=0)
    check_sizes = real.check_sizes

    def cut_after_check(found, keep=None):
        check_sizes(found, keep)
        with open(path, "r+b") as f:  # the kept descriptor sees the cut
            f.truncate(segments[1].offset + 7)

    real.check_sizes = cut_after_check  # type: ignore[method-assign]
    fields = [field_of([s], np.uint8, (3, 2)) for s in segments]
    with pytest.raises(PayloadReadError) as info:
        fill_field("r", fields, dtype=np.dtype(np.uint8), reader=real, pool=DirtyPool())
    assert "short read" in str(info.value)
    assert info.value.r3data_sample == 1


def test_a_ragged_index_claiming_values_past_its_file_is_refused_before_allocating(tmp_path):
    """A ragged handle's index table (bytes from the file) names where its values end: a claim
    past the end of the file is refused before the batch buffer is sized from it."""
    sets = [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)]
    (segment,) = PayloadWriter(tmp_path).write(0, {"r": sets})
    path = tmp_path / segment.file
    data = bytearray(path.read_bytes())
    index = np.frombuffer(data, INDEX_DTYPE, segment.rows + 1, segment.index).copy()
    index[-1] = 2**37  # 512 GiB of int32 values
    data[segment.index : segment.index + segment.nbytes] = index.tobytes()
    path.write_bytes(bytes(data))
    field = StitchedField("r", (segment,), FieldInfo(np.dtype(np.int32), (), True), segment.rows)
    with pytest.raises(SegmentError, match=r"claims bytes up to \d+, but the file has") as info:
        fill_field(
            "r",
            [field],
            dtype=np.dtype(np.int32),
            reader=PayloadReader(tmp_path, retries=0),
            sample_ids=["a"],
        )
    assert info.value.r3data_sample == 0


def test_a_turn_the_buffer_cannot_hold_unscreened_is_a_segment_error():
    """Narrowing is allowed only once ids were screened against ``num_experts``; without, a
    turn of a wider dtype is refused with a typed error naming both dtypes."""
    wide = InlineRows("r", np.full((2, 3, 2), 300, np.int16), 0)
    field = field_of([wide], np.int16, (3, 2))
    with pytest.raises(SegmentError, match=r"expected rows uint8 holds, found int16 at position 0"):
        fill_field("r", [field], dtype=np.dtype(np.uint8))
