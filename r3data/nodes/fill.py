"""The one fill: a batch's stitched fields written into their final buffers in one pass.

For each field the pieces of every sample's plan (:func:`r3data.trace.stitch`) are executed
once, in parallel on the shared pool, into one buffer allocated at its final size:

- inline rows are copied, base64 rows decoded straight into their slice
  (:func:`r3data.wire.blob.decode_base64_into`), by-handle rows read straight into it: one
  read plan for the batch, every file opened once (its claims checked against its size before
  anything is allocated), adjacent ranges of a file in one ``preadv``, checksummed chunk by
  chunk;
- route rows are screened (:mod:`r3data.nodes.screen`) while still in cache: a large piece
  chunk by chunk as it lands, small pieces together in one pass over their rows;
- placeholders are written last, in a few vectorised assignments for the whole batch;
- rows the screen finds missing are a gap, handled by ``on_gap`` as stitching handles one.

Ragged fields (sampling masks) are filled into CSR by :mod:`r3data.nodes.ragged_fill`; a row
with no values is no mask at its token (the full vocabulary), so it is not ``valid``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from r3data.buffers import BufferPool
from r3data.errors import SegmentError, TraceError, TraceGapError
from r3data.nodes.fill_common import (
    MAX_BUFFER_BYTES,
    FilledField,
    allocate,
    check_sizes,
    named,
    naming_failures,
    torch_dtype,
)
from r3data.nodes.ragged_fill import fill_ragged
from r3data.nodes.screen import RowFlags, ScreenOptions, screen_rows
from r3data.packed import PackedTensor, aranges
from r3data.packed_ragged import PackedRagged
from r3data.parallel import pool_workers
from r3data.payload.reader import OpenFiles, PayloadReader, Plan, RangeRead
from r3data.ragged import RaggedRows
from r3data.spans import format_spans, merge
from r3data.trace.stitch import OnGap, PlaceholderRows, StitchedField, StitchStats, distinct_row
from r3data.wire.rows import EncodedRows, InlineRows
from r3data.wire.segment import PayloadSegment

__all__ = ["MAX_BUFFER_BYTES", "FilledField", "fill_field", "materialize", "torch_dtype"]

_SMALL = 256 << 10
"""Pieces below this many bytes are screened together after the fill, not one by one."""
_JOB_BYTES = 4 << 20
_LANE_BYTES = 16 << 20
"""A second thread pays for itself from about this many bytes of a field (below, handing the
jobs out costs more than it wins)."""
"""Inline pieces are cut into jobs of about this many bytes (parallel, cache-friendly)."""


@dataclass(slots=True, eq=False)  # one per piece per batch: a plain record is cheapest
class _Placed:
    """A piece placed at batch rows ``[lo, lo + piece.rows)`` of sample ``sample``."""

    piece: InlineRows | EncodedRows | PayloadSegment
    lo: int
    sample: int
    real: bool

    def position(self, row: int) -> int:
        """The token position of batch row ``row`` (inside this piece)."""
        return self.piece.pos + row - self.lo

    def where(self) -> str:
        return f" in file {self.piece.file}" if type(self.piece) is PayloadSegment else ""


class _Flags:
    """Rows the screen flagged, gathered from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.missing: list[np.ndarray] = []
        self.zero = 0
        self.negative = 0

    def add(self, rows: np.ndarray, zero: int, negative: int) -> None:
        with self.lock:
            self.missing.append(rows)
            self.zero += zero
            self.negative += negative


class _FixedFill:
    """The fill of one fixed-width field (see the module docstring): plan, allocate, run,
    finish."""

    def __init__(
        self,
        name: str,
        fields: Sequence[StitchedField],
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        reader: PayloadReader | None,
        screen: ScreenOptions | None,
    ) -> None:
        self.name = name
        self.fields = fields
        self.row_shape = row_shape
        self.dtype = dtype
        self.reader = reader
        self.screen = screen
        self.row_bytes = dtype.itemsize * math.prod(row_shape)
        self.offsets = np.zeros(len(fields) + 1, np.int64)
        """Each sample's first batch row, and the batch's rows (set by :meth:`plan`)."""
        self.out: np.ndarray = np.empty((0, *row_shape), dtype)
        self.flags = _Flags()
        self.placed: list[_Placed] = []
        """Pieces (and the source rows placeholders repeat) at their batch rows, in row order."""
        self.segments: list[PayloadSegment] = []
        """The by-handle pieces among them, whose claims are checked before allocating."""
        self.range_samples: dict[int, int] = {}
        """``id`` of each range read -> the sample it is in (a failed read names its sample)."""
        self.placeholders: dict[str, list[tuple[int, int]]] = {
            "repeat_previous": [],
            "distinct": [],
            "fill": [],
        }
        self.repeat_before: list[tuple[int, int]] = []
        """Placeholders repeating the batch row just before them (their source's row)."""
        self.small: list[_Placed] = []
        self.staged: list[tuple[_Placed, np.ndarray]] = []

    # --- planning -----------------------------------------------------------------------------

    def plan(self) -> dict[int, int]:
        """Place every piece at its batch rows; returns the by-handle ones (``id`` of the
        segment -> the sample it is in), to check before allocating."""
        handles: dict[int, int] = {}
        starts = []
        lo = 0
        for sample, stitched in enumerate(self.fields):
            starts.append(lo)
            previous = None
            for piece in stitched.pieces:
                if type(piece) is PlaceholderRows:
                    if piece.source is not None and _repeats_previous(piece, previous):
                        self.repeat_before.append((lo, piece.rows))  # already in the buffer
                    else:
                        self.placeholders[piece.kind].append((lo, piece.rows))
                        if piece.source is not None:  # the one row it repeats comes first
                            self.placed.append(_Placed(piece.source, lo, sample, real=False))
                            if type(piece.source) is PayloadSegment:
                                self.segments.append(piece.source)
                                handles.setdefault(id(piece.source), sample)
                else:
                    if piece.row_shape != self.row_shape:
                        raise named(
                            SegmentError(
                                f"field {self.name!r}: expected rows of shape {self.row_shape}, "
                                f"found {piece.row_shape} at position {piece.pos}"
                            ),
                            sample,
                        )
                    self.placed.append(_Placed(piece, lo, sample, real=True))
                    if type(piece) is PayloadSegment:
                        self.segments.append(piece)
                        handles.setdefault(id(piece), sample)
                lo += piece.rows
                previous = piece
        starts.append(lo)
        self.offsets = np.array(starts, np.int64)
        if handles and self.reader is None:
            raise named(
                SegmentError(f"field {self.name!r}: a by-handle piece needs a payload reader"),
                next(iter(handles.values())),
            )
        return handles

    def jobs(self, opened: OpenFiles, stop: threading.Event) -> list[Callable[[], None]]:
        """The fill's work, bound to the allocated buffer :attr:`out`: file reads first (the
        files ``opened`` to check their sizes are read without opening them again), each
        stopped at its next call to the filesystem once ``stop`` is set."""
        ranges: list[RangeRead] = []
        tasks: list[tuple[InlineRows | EncodedRows, np.ndarray, _Placed, int, bool]] = []
        out_bytes = memoryview(self.out.reshape(-1).view(np.uint8))  # the buffer, byte by byte
        row_bytes = self.row_bytes
        for placed in self.placed:
            piece, rows = placed.piece, placed.piece.rows
            if rows == 0:
                continue
            same = self.dtype == piece.dtype
            big = self.screen is not None and rows * row_bytes >= _SMALL
            if not same:  # a turn of another dtype: staged, screened, then converted
                staged = np.empty((rows, *self.row_shape), piece.dtype)
                self.staged.append((placed, staged))
                dest = staged
            else:
                dest = None  # the buffer's rows [placed.lo, placed.lo + rows)
                if not big:
                    self.small.append(placed)
            sink = _Sink(self, placed) if same and big else None
            if type(piece) is PayloadSegment:
                if dest is None:
                    view = out_bytes[placed.lo * row_bytes : (placed.lo + rows) * row_bytes]
                else:
                    view = memoryview(dest.reshape(-1).view(np.uint8))
                read = RangeRead(
                    piece,
                    piece.offset,
                    piece.nbytes,
                    view,
                    piece.crc32c,
                    on_bytes=None if sink is None else sink.advance,
                )
                ranges.append(read)
                self.range_samples[id(read)] = placed.sample
                continue
            if dest is None:
                dest = self.out[placed.lo : placed.lo + rows]
            step = max(1, _JOB_BYTES // max(self.row_bytes, 1))
            for first in range(0, rows, step):
                end = min(first + step, rows)
                part = piece.clipped(piece.pos + first, piece.pos + end)
                tasks.append((part, dest[first:end], placed, first, sink is not None))
        jobs = [lambda group=group: self._copy_all(group) for group in _grouped(tasks)]
        if ranges:
            jobs = self.reader.file_jobs(ranges, opened, stop=stop) + jobs
        return jobs

    # --- execution ----------------------------------------------------------------------------

    def _copy_all(self, tasks: list) -> None:
        for task in tasks:
            self._copy(*task)

    def _copy(
        self,
        part: InlineRows | EncodedRows,
        dest: np.ndarray,
        placed: _Placed,
        first: int,
        screened: bool,
    ) -> None:
        sink = _Sink(self, placed, first) if screened else None
        try:
            if type(part) is EncodedRows:
                part.decode_into(dest, None if sink is None else sink.advance)
            else:
                np.copyto(dest, part.array)
                if sink is not None:
                    sink.advance(dest.nbytes)
        except Exception as exc:
            raise named(exc, placed.sample) from None

    def convert_staged(self) -> None:
        """Screen rows that arrived in another dtype, then convert them into the buffer
        (narrowing only once their ids were screened against ``num_experts``)."""
        narrowing = self.screen is not None and self.screen.num_experts is not None
        for placed, staged in self.staged:
            try:
                if not narrowing and not np.can_cast(staged.dtype, self.dtype):
                    raise SegmentError(
                        f"field {self.name!r}: expected rows {self.dtype} holds, found "
                        f"{staged.dtype} at position {placed.piece.pos} (narrowing needs the "
                        f"screen's num_experts)"
                    )
                self.check(staged, placed)
                dest = self.out[placed.lo : placed.lo + placed.piece.rows]
                np.copyto(dest, staged, casting="unsafe" if narrowing else "safe")
            except Exception as exc:
                raise named(exc, placed.sample) from None

    # --- screening ----------------------------------------------------------------------------

    def check(self, rows: np.ndarray, placed: _Placed, first: int = 0) -> None:
        """Screen ``rows``, the rows of ``placed`` from its row ``first``: refuse what the
        options refuse, remember what is missing."""
        if self.screen is None:
            return
        flags = screen_rows(rows, self.screen)
        if flags.too_large is not None:
            row, entry, value = flags.too_large
            layer = entry // self.row_shape[-1] if len(self.row_shape) > 1 else 0
            raise named(
                TraceError(
                    f"field {self.name!r}{placed.where()}: expected expert ids in "
                    f"[0, {self.screen.num_experts}), found {value} at position "
                    f"{placed.piece.pos + first + row} (layer {layer})"
                ),
                placed.sample,
            )
        zero, negative = flags.zero, flags.negative
        if zero is None and negative is None:
            return
        if zero is not None and self.screen.zero_rows == "raise":
            at = placed.piece.pos + first + np.flatnonzero(zero)
            raise named(
                TraceError(
                    f"field {self.name!r}{placed.where()}: route rows at positions "
                    f"{at[:8].tolist()} are zero in every layer (an engine bug)"
                ),
                placed.sample,
            )
        if zero is None:
            bad = negative
        elif negative is None:
            bad = zero
        else:
            bad = zero | negative
        self.flags.add(
            placed.lo + first + np.flatnonzero(bad),
            0 if zero is None else int(zero.sum()),
            0 if negative is None else int(negative.sum()),
        )

    def screen_small(self) -> None:
        """Screen the small pieces together: one pass per run of batch rows they fill, the
        placeholder rows between them screened too and their findings ignored; only a run
        with a finding in an engine row is screened again piece by piece, for exact
        positions. A placeholder's own source row is screened alone."""
        if not self.small or self.screen is None:
            return
        for placed in self.small:
            if not placed.real:
                self.check(self.out[placed.lo : placed.lo + placed.piece.rows], placed)
        order = [p for p in self.small if p.real]  # in batch row order, as they were placed
        if not order:
            return
        real = self.valid()
        starts = np.array([p.lo for p in order], np.int64)
        stops = starts + np.array([p.piece.rows for p in order], np.int64)
        for lo, hi in _joined(starts, stops):
            if not self._finds(screen_rows(self.out[lo:hi], self.screen), real[lo:hi], lo, hi):
                continue
            for placed in order[
                int(np.searchsorted(starts, lo)) : int(np.searchsorted(starts, hi))
            ]:
                self.check(self.out[placed.lo : placed.lo + placed.piece.rows], placed)

    def _finds(self, flags: RowFlags, real: np.ndarray, lo: int, hi: int) -> bool:
        """Whether ``flags`` of batch rows ``[lo, hi)`` found anything in an engine row."""
        for mask in (flags.zero, flags.negative):
            if mask is not None and (mask & real).any():
                return True
        if flags.too_large is None:
            return False
        if real[flags.too_large[0]]:
            return True
        return screen_rows(self.out[lo:hi][real], self.screen).too_large is not None

    def valid(self) -> np.ndarray:
        """Bool per batch row: True where a source (an engine row) fills it, False where a
        placeholder does."""
        valid = np.ones(int(self.offsets[-1]), bool)
        for spans in (self.repeat_before, *self.placeholders.values()):
            if spans:
                los, counts = np.array(spans, np.int64).T
                valid[aranges(los, counts)] = False
        return valid

    # --- after the fill -----------------------------------------------------------------------

    def finish(self, topk: int | None, on_gap: OnGap, sample_ids: Sequence[str]) -> FilledField:
        """Placeholders, and ``on_gap`` for rows the screen found missing."""
        valid = self.valid()
        filled = FilledField(values=None, valid=valid)  # type: ignore[arg-type]
        drop_routes: list[int] = []
        if self.flags.missing:
            missing = np.unique(np.concatenate(self.flags.missing))
            fake = missing[~valid[missing]]  # a placeholder's source row: never replayed
            if fake.size:
                self.out[fake] = self._distinct(topk)
            real = missing[valid[missing]]
            if real.size:
                drop_routes = self._gaps(real, on_gap, sample_ids, filled)
        self._placeholders(topk)
        for sample in drop_routes:
            lo, hi = int(self.offsets[sample]), int(self.offsets[sample + 1])
            self.out[lo:hi] = self._distinct(topk)
            valid[lo:hi] = False
        return filled

    def _distinct(self, topk: int | None) -> np.ndarray:
        return distinct_row(self.row_shape, self.dtype, topk)

    def _gaps(
        self, rows: np.ndarray, on_gap: OnGap, sample_ids: Sequence[str], filled: FilledField
    ) -> list[int]:
        """Apply ``on_gap`` to the samples whose engine rows the screen found missing."""
        samples = np.searchsorted(self.offsets, rows, "right") - 1
        drop: list[int] = []
        for sample in np.unique(samples).tolist():
            lo, hi = int(self.offsets[sample]), int(self.offsets[sample + 1])
            at = rows[samples == sample]
            message = (
                f"sample {sample_ids[sample]!r} field {self.name!r}: {at.size} route rows at "
                f"positions {format_spans(_spans(self._positions(sample, at)))} are missing "
                f"(zero in every layer, an engine bug, or holding a negative id: no route)"
            )
            if on_gap == "raise":
                raise named(TraceGapError(message), sample)
            if on_gap == "drop_sample":
                filled.dropped.append(sample)
                filled.warnings.append(f"{message}; sample dropped")
                continue
            captured = int(filled.valid[lo:hi].sum())
            drop.append(sample)
            filled.warnings.append(f"{message}; every row of {self.name!r} is a placeholder")
            filled.stats += StitchStats(
                rows_captured=-captured,
                placeholders=captured,
                gaps=1,
                rows_dropped=captured - at.size,
                rows_missing=at.size,
            )
        return drop

    def _positions(self, sample: int, rows: np.ndarray) -> np.ndarray:
        """Token positions of batch rows of ``sample``, from its pieces."""
        lo = int(self.offsets[sample])
        starts, firsts = [], []
        for piece in self.fields[sample].pieces:
            starts.append(lo)
            firsts.append(piece.pos)
            lo += piece.rows
        index = np.searchsorted(np.array(starts), rows, "right") - 1
        return np.array(firsts, np.int64)[index] + rows - np.array(starts, np.int64)[index]

    def _placeholders(self, topk: int | None) -> None:
        if self.repeat_before:
            los, counts = np.array(self.repeat_before, np.int64).T
            self.out[aranges(los, counts)] = self.out[np.repeat(los - 1, counts)]
        repeat = self.placeholders["repeat_previous"]
        if repeat:
            los, counts = np.array(repeat, np.int64).T
            more = counts - 1
            if more.sum():
                self.out[aranges(los + 1, more)] = self.out[np.repeat(los, more)]
        for kind in ("distinct", "fill"):
            spans = self.placeholders[kind]
            if spans:
                los, counts = np.array(spans, np.int64).T
                self.out[aranges(los, counts)] = 0 if kind == "fill" else self._distinct(topk)


class _Sink:
    """Screens a large piece's rows as its bytes land, chunk by chunk; ``first`` is the row of
    the piece its destination starts at."""

    __slots__ = ("fill", "first", "placed", "screened")

    def __init__(self, fill: _FixedFill, placed: _Placed, first: int = 0) -> None:
        self.fill, self.placed, self.first, self.screened = fill, placed, first, 0

    def advance(self, done: int) -> None:
        rows = done // self.fill.row_bytes
        if rows > self.screened:
            lo = self.placed.lo + self.first
            self.fill.check(
                self.fill.out[lo + self.screened : lo + rows],
                self.placed,
                self.first + self.screened,
            )
            self.screened = rows


def _joined(starts: np.ndarray, stops: np.ndarray, gap: int = 64) -> list[tuple[int, int]]:
    """Spans ``[starts[i], stops[i])`` (non-empty, ordered by start) merged, and joined across
    holes of at most ``gap`` rows."""
    if not starts.size:
        return []
    reach = np.maximum.accumulate(stops)  # the end of the run each span extends so far
    cuts = np.flatnonzero(starts[1:] - reach[:-1] > gap) + 1
    firsts = np.concatenate(([0], cuts))
    lasts = np.concatenate((cuts - 1, [starts.size - 1]))
    return list(zip(starts[firsts].tolist(), reach[lasts].tolist(), strict=True))


def _grouped(tasks: list) -> list[list]:
    """Copy tasks in groups of about :data:`_JOB_BYTES` (a large piece alone, many small ones
    together): one job each, so small samples do not pay a job's overhead apiece."""
    groups: list[list] = []
    size = _JOB_BYTES
    for task in tasks:
        nbytes = task[1].nbytes
        if size + nbytes > _JOB_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(task)
        size += nbytes
    return groups


def _repeats_previous(placeholder: PlaceholderRows, previous: object) -> bool:
    """Whether the row ``placeholder`` repeats is the last of the piece just before it (so it
    is in the buffer already, screened): true unless a rank-local cut took that piece away."""
    return (
        previous is not None
        and type(previous) is not PlaceholderRows
        and previous.end == placeholder.pos
        and placeholder.source.pos == previous.end - 1
        and placeholder.source.field == previous.field
    )


def _spans(positions: np.ndarray) -> list[tuple[int, int]]:
    return merge((int(p), int(p) + 1) for p in positions)


def fill_field(
    name: str,
    fields: Sequence[StitchedField],
    *,
    dtype: np.dtype,
    reader: PayloadReader | None = None,
    screen: ScreenOptions | None = None,
    on_gap: OnGap = "drop_routes",
    sample_ids: Sequence[str] | None = None,
    workers: int | None = None,
    pin_memory: bool = False,
    pool: BufferPool | None = None,
) -> FilledField:
    """Fill one field of a batch from every sample's stitched ``fields`` (one per sample).

    ``screen`` (route fields) screens every engine row; ``dtype`` is the buffer's (pieces of
    another dtype are converted, narrowing only after their ids were screened against
    ``num_experts``). Failures carry the batch index of their sample (``exc.r3data_sample``).
    """
    ids = sample_ids if sample_ids is not None else [str(i) for i in range(len(fields))]
    workers = pool_workers() if workers is None else workers
    if fields and fields[0].ragged:
        return fill_ragged(name, fields, dtype, reader, workers, pin_memory, pool)
    row_shapes = {f.row_shape for f in fields}
    if len(row_shapes) > 1:
        raise SegmentError(
            f"field {name!r}: every sample of a batch needs the same row shape, found "
            f"{sorted(row_shapes)} in samples {list(ids)}"
        )
    fill = _FixedFill(name, fields, row_shapes.pop() if row_shapes else (), dtype, reader, screen)
    handles = fill.plan()
    opened = OpenFiles()
    try:
        if handles:  # claims are checked against the files before anything is allocated
            check_sizes(reader, fill.segments, handles, opened)
        shape = (int(fill.offsets[-1]), *fill.row_shape)
        values = allocate(shape, dtype, name=name, pin_memory=pin_memory, pool=pool)
        fill.out = values.numpy()
        plan = Plan()  # a failed job or an interrupt stops every other at its next call
        jobs = fill.jobs(opened, plan.stop)
        lanes = min(workers, max(1, fill.out.nbytes // _LANE_BYTES))  # small batches: one
        with naming_failures("r3data_range", fill.range_samples):  # a read names its sample
            plan.run(lambda i: jobs[i](), len(jobs), lanes)
    finally:
        opened.close()
    fill.convert_staged()
    fill.screen_small()
    filled = fill.finish(fields[0].topk if fields else None, on_gap, ids)
    filled.values = PackedTensor(values, fill.offsets)
    return filled


def materialize(
    stitched: StitchedField,
    reader: PayloadReader | None = None,
    *,
    screen: ScreenOptions | None = None,
    on_gap: OnGap = "drop_routes",
) -> np.ndarray | RaggedRows:
    """One sample's stitched field as one array ``[sample_len, *row_shape]`` (ragged fields:
    :class:`~r3data.ragged.RaggedRows`), through the loader's own fill; by-handle pieces are
    read through ``reader``."""
    filled = fill_field(
        stitched.name,
        [stitched],
        dtype=stitched.dtype,
        reader=reader,
        screen=screen,
        on_gap=on_gap,
        workers=1,
    )
    if isinstance(filled.values, PackedRagged):
        return filled.values.segment(0)
    return filled.values.values.numpy()
