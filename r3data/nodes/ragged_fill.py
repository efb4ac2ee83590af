"""The fill of a ragged field (sampling masks): rows of varying width into CSR, every value
copied once. Row lengths come first (by-handle index tables, and the -1-padded rows some
producers write, are read for them), then every value lands in one buffer, where integer
values are screened once as token ids, whichever source they came from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3data.buffers import BufferPool
from r3data.errors import SegmentError, TraceError
from r3data.nodes.fill_common import (
    FilledField,
    allocate,
    check_sizes,
    named,
    naming_failures,
)
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.parallel import fill_rows
from r3data.payload.reader import OpenFiles, PayloadReader, Plan, RangeRead, values_range
from r3data.ragged import MAX_TOKEN_ID, RaggedRows, first_bad_id
from r3data.trace.stitch import Piece, PlaceholderRows, StitchedField
from r3data.wire.segment import PayloadSegment

__all__ = ["fill_ragged"]


def fill_ragged(
    name: str,
    fields: Sequence[StitchedField],
    dtype: np.dtype,
    reader: PayloadReader | None,
    workers: int,
    pin_memory: bool,
    pool: BufferPool | None,
) -> FilledField:
    """Ragged rows into CSR: the row lengths first (index tables and padded rows are read for
    them), then every value once into one buffer."""
    pieces = [(sample, piece) for sample, f in enumerate(fields) for piece in f.pieces]
    handles = {id(p): sample for sample, p in pieces if type(p) is PayloadSegment}
    if handles:
        if reader is None:
            raise SegmentError(f"field {name!r}: a by-handle piece needs a payload reader")
        check_sizes(reader, [p for _, p in pieces if id(p) in handles], handles)
    first: list[RangeRead] = []  # index tables (ragged) or the rows themselves (padded)
    samples: dict[int, int] = {}  # id of each range read -> its sample (a failure names it)
    for sample, piece in pieces:
        if type(piece) is PayloadSegment and piece.rows:
            where = (piece.index, piece.nbytes) if piece.ragged else (piece.offset, piece.nbytes)
            first.append(RangeRead(piece, *where, crc=None if piece.ragged else piece.crc32c))
            samples[id(first[-1])] = sample
    if first:
        with naming_failures("r3data_range", samples):
            reader.read_ranges(first)
    runs: list[RaggedRows | RangeRead | int] = []  # per piece: its rows, a values range, or empty
    tables = iter(first)
    for _, piece in pieces:
        if type(piece) is PlaceholderRows:
            runs.append(piece.rows)
        elif type(piece) is PayloadSegment:
            if not piece.rows:
                runs.append(0)
            elif piece.ragged:
                runs.append(next(tables))
            else:
                padded = next(tables).array().view(piece.dtype).reshape(piece.rows, *piece.shape)
                runs.append(RaggedRows.from_padded(padded, what=f"{piece.file} {name!r}"))
        elif isinstance(piece.array, RaggedRows):
            runs.append(piece.array)
        else:  # the trace builder makes padded inline rows ragged; a hand-made trace may not
            raise SegmentError(
                f"field {name!r}: expected ragged rows, found rows of shape "
                f"{list(piece.array.shape)} at position {piece.pos}"
            )
    lengths: list[np.ndarray] = []
    reads: list[tuple[RangeRead, np.ndarray]] = []
    for i, run in enumerate(runs):
        if isinstance(run, int):
            lengths.append(np.zeros(run, np.int64))
        elif isinstance(run, RaggedRows):
            lengths.append(run.lengths)
        else:
            values, index = values_range(run)
            reads.append((values, index))
            samples[id(values)] = samples[id(run)]
            runs[i] = values
            lengths.append(np.diff(index))
    found = next((r.segment.dtype for r, _ in reads if r.segment.dtype != dtype), None)
    if found is not None:
        raise SegmentError(
            f"field {name!r}: expected ragged rows by handle of {dtype}, found {found}"
        )
    row_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    row_offsets = np.zeros(row_lengths.size + 1, np.int64)
    np.cumsum(row_lengths, out=row_offsets[1:])
    opened = OpenFiles()
    try:
        if reads:  # what the index tables claim (file bytes), checked before allocating
            with naming_failures("r3data_segment", handles):
                reader.check_ranges([r for r, _ in reads], opened)
        values = allocate(
            (int(row_offsets[-1]),), dtype, name=name, pin_memory=pin_memory, pool=pool
        )
        out = values.numpy()
        cursor = 0
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        for run, length in zip(runs, lengths, strict=True):
            n = int(length.sum())
            dest = out[cursor : cursor + n]
            cursor += n
            if isinstance(run, RaggedRows):
                copies.append((dest, run.compact()[0]))
            elif isinstance(run, RangeRead):
                run.dest = memoryview(dest.view(np.uint8))
        if reads:
            plan = Plan()  # a failed read or an interrupt stops every other at its next call
            jobs = reader.file_jobs([r for r, _ in reads], opened, stop=plan.stop)
            with naming_failures("r3data_range", samples):
                plan.run(lambda i: jobs[i](), len(jobs), reader.workers)
    finally:
        opened.close()
    fill_rows(lambda i: np.copyto(*copies[i], casting="safe"), len(copies), workers)
    bad = first_bad_id(out)
    if bad is not None:
        raise _bad_id(name, pieces, row_offsets, bad, out[bad].item())
    sample_rows = np.zeros(len(fields) + 1, np.int64)
    np.cumsum([sum(p.rows for p in f.pieces) for f in fields], out=sample_rows[1:])
    valid = np.concatenate(
        [np.full(p.rows, type(p) is not PlaceholderRows) for _, p in pieces] or [np.zeros(0, bool)]
    )
    valid &= row_lengths > 0  # a row with no ids is no mask there (the full vocabulary)
    rows = PackedTensor(values, row_offsets)
    return FilledField(values=PackedRagged(rows, sample_rows), valid=valid)


def _bad_id(
    name: str,
    pieces: list[tuple[int, Piece]],
    row_offsets: np.ndarray,
    index: int,
    value: int,
) -> Exception:
    """The refusal of the value at ``index`` of the batch's values, naming its sample, its
    file (by handle) and its token position."""
    row = int(np.searchsorted(row_offsets, index, side="right")) - 1
    starts = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum([piece.rows for _, piece in pieces], out=starts[1:])
    at = int(np.searchsorted(starts, row, side="right")) - 1  # empty pieces share a start
    sample, piece = pieces[at]
    where = f" in file {piece.file}" if type(piece) is PayloadSegment else ""
    return named(
        TraceError(
            f"field {name!r}{where}: expected token ids in [0, {MAX_TOKEN_ID}] (-1 pads, never "
            f"an id), found {value} at position {piece.pos + row - int(starts[at])}"
        ),
        sample,
    )
