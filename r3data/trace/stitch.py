"""``stitch``: one sample's rows per field, as pieces covering ``[0, sample_len)`` exactly.

The pieces are the plan the loader's fill executes in one pass: sources (views, clipped
handles, narrowed blobs; nothing is read or decoded here) and :class:`PlaceholderRows` where
the engine produced no row, which are ``valid`` False:

- positions the engine never forwards or that the trainer appended (the last token, a synthetic
  EOS) take, for routes, a copy of the previous row (``"repeat_previous"``: the placeholder
  names that one row as its source) or distinct experts ``arange(topk)`` (``"distinct"``, also
  used where no previous row exists); for other fields a fill row (0, or an empty row for
  ragged fields), e.g. prompt tokens, which have no sampling mask;
- positions where the engine should have produced a row but did not are a gap, handled by
  ``on_gap``: ``"drop_routes"`` makes every row of that field a placeholder (all invalid, with a
  warning), ``"drop_sample"`` returns None, ``"raise"`` raises :class:`TraceGapError`. Rows the
  fill's screen finds missing (all-zero engine rows, ``-1`` ids) are a gap too, under the same
  policy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal

import numpy as np

from r3data.errors import ConfigError, TraceError, TraceGapError
from r3data.spans import complement, format_spans, intersect
from r3data.trace.builder import ROUTES_FIELD, FieldInfo, Source, Trace, TraceBuilder, clip_source
from r3data.validate import checked_int, nonnegative_int

__all__ = [
    "GAP_POLICIES",
    "check_stitch_options",
    "stitch_checked",
    "OnGap",
    "Placeholder",
    "PlaceholderRows",
    "StitchStats",
    "StitchedField",
    "StitchedSample",
    "check_on_gap",
    "distinct_row",
    "stitch",
]

Placeholder = Literal["repeat_previous", "distinct"]
OnGap = Literal["drop_routes", "drop_sample", "raise"]
GAP_POLICIES = ("drop_routes", "drop_sample", "raise")
NO_RAGGED_ROWS = FieldInfo(np.dtype(np.int32), (), True)
"""The form of a ragged field no request sent: empty rows, int32 (the dtype every producer
sends masks in) where no sample of a batch sent the field; its dtype is no sample's, so it
does not count toward the batch's (see :attr:`StitchedField.sent`)."""

logger = logging.getLogger(__name__)


def check_on_gap(on_gap: object) -> OnGap:
    if on_gap not in GAP_POLICIES:
        raise ConfigError(
            f"on_gap: expected 'drop_routes', 'drop_sample' or 'raise', found {on_gap!r}"
        )
    return on_gap  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class PlaceholderRows:
    """Rows ``[pos, pos + rows)`` of ``field`` the engine did not produce. ``kind`` says what
    the fill writes there: ``"repeat_previous"`` (the one row of ``source``, repeated),
    ``"distinct"`` (experts ``0..topk-1``) or ``"fill"`` (zeros; empty ragged rows)."""

    field: str
    pos: int
    rows: int
    kind: str
    source: Source | None = None

    @property
    def end(self) -> int:
        return self.pos + self.rows

    def clipped(self, lo: int, hi: int) -> PlaceholderRows:
        return PlaceholderRows(self.field, lo, hi - lo, self.kind, self.source)


Piece = Source | PlaceholderRows


@dataclass(frozen=True, slots=True)
class StitchStats:
    """Counts for one sample (summed over its fields) or, added up, for a batch."""

    samples: int = 0
    samples_dropped: int = 0
    rows_captured: int = 0
    """Rows the engine produced, kept in the sample (``valid`` True)."""
    placeholders: int = 0
    gaps: int = 0
    """Ranges where rows were missing inside a sample."""
    rows_dropped: int = 0
    """Rows the engine produced but ``on_gap="drop_routes"`` discarded."""
    rows_missing: int = 0
    """Rows the screen found missing (all-zero engine rows, ``-1`` ids): the gaps' cause."""
    bytes: int = 0
    """Bytes of captured rows as the engine stored them (a ragged handle: its index table)."""

    def __add__(self, other: StitchStats) -> StitchStats:
        return StitchStats(
            self.samples + other.samples,
            self.samples_dropped + other.samples_dropped,
            self.rows_captured + other.rows_captured,
            self.placeholders + other.placeholders,
            self.gaps + other.gaps,
            self.rows_dropped + other.rows_dropped,
            self.rows_missing + other.rows_missing,
            self.bytes + other.bytes,
        )

    @classmethod
    def total(cls, samples: Iterable[StitchedSample | None]) -> StitchStats:
        """Batch statistics; a None (a sample dropped by ``on_gap="drop_sample"``) counts as
        one dropped sample."""
        samples = list(samples)
        kept = [sample.stats for sample in samples if sample is not None]
        sums = [*map(sum, zip(*map(_COUNTS, kept), strict=True))] if kept else [0] * _FIELDS
        dropped = len(samples) - len(kept)
        sums[0] += dropped
        sums[1] += dropped
        return cls(*sums)


_COUNTS = attrgetter(*(f.name for f in dataclasses.fields(StitchStats)))
"""Every count of a :class:`StitchStats`, in field order."""
_FIELDS = len(dataclasses.fields(StitchStats))


class StitchedField:
    """One field of a sample: ``pieces`` in position order, covering ``[0, sample_len)``;
    ``topk`` is the width of a distinct placeholder row (None: the row's last axis);
    ``sent``: False for a ragged field no request of the trace sent, whose ``dtype`` is only
    :data:`NO_RAGGED_ROWS`'s (a batch takes its dtype from the samples that sent the field)."""

    __slots__ = (
        "_valid",
        "dtype",
        "name",
        "pieces",
        "ragged",
        "row_shape",
        "sample_len",
        "sent",
        "topk",
    )

    def __init__(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        info: FieldInfo,
        sample_len: int,
        topk: int | None = None,
        *,
        sent: bool = True,
    ) -> None:
        self.name = name
        self.pieces = pieces
        self.dtype = info.dtype
        self.row_shape = info.row_shape
        self.ragged = info.ragged
        self.sample_len = sample_len
        self.topk = topk
        self.sent = sent
        self._valid: np.ndarray | None = None

    @property
    def info(self) -> FieldInfo:
        return FieldInfo(self.dtype, self.row_shape, self.ragged)

    def with_pieces(self, pieces: tuple[Piece, ...]) -> StitchedField:
        """The same field holding only ``pieces`` (e.g. one rank's share of the positions)."""
        return StitchedField(
            self.name, pieces, self.info, self.sample_len, self.topk, sent=self.sent
        )

    @property
    def valid(self) -> np.ndarray:
        """Bool ``[sample_len]`` by position: True where a source (an engine row) fills it."""
        if self._valid is None:
            valid = np.zeros(self.sample_len, dtype=bool)
            for piece in self.pieces:
                if type(piece) is not PlaceholderRows:
                    valid[piece.pos : piece.end] = True
            self._valid = valid
        return self._valid


@dataclass(frozen=True, eq=False, slots=True)
class StitchedSample:
    """A sample's stitched fields; ``valid`` is the first field's (the routes by default)."""

    trace_id: str
    sample_len: int
    fields: Mapping[str, StitchedField]
    stats: StitchStats
    warnings: tuple[str, ...] = ()

    @property
    def valid(self) -> np.ndarray:
        return next(iter(self.fields.values())).valid

    def __getitem__(self, field: str) -> StitchedField:
        return self.fields[field]


def distinct_row(
    row_shape: tuple[int, ...], dtype: np.dtype, topk: int | None = None
) -> np.ndarray:
    """A route row naming experts ``0..topk-1`` in every layer: a padding row the all-to-all
    dispatcher accepts (it expects ``topk`` distinct experts per token)."""
    last = row_shape[-1] if row_shape else 1
    k = last if topk is None else nonnegative_int("topk", topk)
    fits = k >= 1 and last % k == 0 and (k == last or len(row_shape) == 1)
    if not fits or k - 1 > np.iinfo(dtype).max:
        raise TraceError(
            f"distinct placeholder: expected topk dividing rows of shape {list(row_shape)} "
            f"(the last axis when rows are [layers, topk]) and fitting {dtype}, found {topk}"
        )
    return np.tile(np.arange(k, dtype=dtype), math.prod(row_shape) // k).reshape(row_shape)


def _window(pieces: tuple[Source, ...], n: int) -> list[Source]:
    """The pieces inside positions ``[0, n)``, the last one clipped."""
    if not pieces or pieces[-1].end <= n:
        return list(pieces)
    inside = list(pieces[: bisect_left(pieces, n, key=lambda p: p.pos)])
    if inside and inside[-1].end > n:
        inside[-1] = clip_source(inside[-1], inside[-1].pos, n)
    return inside


def _filled(real: list[Source], n: int, field: str, kind: str) -> list[Piece]:
    """``real`` pieces with placeholders in every hole of ``[0, n)``, in position order."""
    out: list[Piece] = []
    cursor = 0
    previous: Source | None = None
    for piece in real:
        if piece.pos > cursor:
            out.append(_placeholder(field, cursor, piece.pos, kind, previous))
        out.append(piece)
        cursor, previous = piece.end, piece
    if cursor < n:
        out.append(_placeholder(field, cursor, n, kind, previous))
    return out


def _placeholder(
    field: str, lo: int, hi: int, kind: str, previous: Source | None
) -> PlaceholderRows:
    if kind == "repeat_previous":
        if previous is None:
            return PlaceholderRows(field, lo, hi - lo, "distinct")
        last = clip_source(previous, previous.end - 1, previous.end)
        return PlaceholderRows(field, lo, hi - lo, kind, last)
    return PlaceholderRows(field, lo, hi - lo, kind)


def stitch(
    trace: Trace | TraceBuilder,
    sample_len: int,
    *,
    fields: Sequence[str] = (ROUTES_FIELD,),
    placeholder: Placeholder = "repeat_previous",
    on_gap: OnGap = "drop_routes",
    topk: int | None = None,
) -> StitchedSample | None:
    """Stitch positions ``[0, sample_len)`` of ``trace`` for each of ``fields``.

    ``placeholder`` applies to the trace's routes field; ``topk`` overrides the last axis of a
    route row for distinct placeholders (needed for flat ``[layers * topk]`` rows). Returns None
    when ``on_gap="drop_sample"`` and a field has a gap.
    """
    if isinstance(trace, TraceBuilder):
        trace = trace.build()
    n = nonnegative_int("sample_len", sample_len, TraceError)
    return stitch_checked(trace, n, check_stitch_options(fields, placeholder, on_gap, topk))


def check_stitch_options(
    fields: Sequence[str], placeholder: object, on_gap: object, topk: object
) -> tuple[tuple[str, ...], Placeholder, OnGap, int | None]:
    """``stitch``'s options, checked once (a loader stitches every sample with the same)."""
    if placeholder not in ("repeat_previous", "distinct"):
        raise ConfigError(
            f"placeholder: expected 'repeat_previous' or 'distinct', found {placeholder!r}"
        )
    check_on_gap(on_gap)
    if topk is not None:
        checked_int("topk", topk, minimum=1)
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"fields: expected distinct field names, found {list(names)!r}")
    return names, placeholder, on_gap, topk  # type: ignore[return-value]


def stitch_checked(
    trace: Trace, n: int, options: tuple[tuple[str, ...], Placeholder, OnGap, int | None]
) -> StitchedSample | None:
    """:func:`stitch` of a built trace with options :func:`check_stitch_options` returned."""
    names, placeholder, on_gap, topk = options
    warnings = list(trace.warnings)
    counts = [0, 0, 0, 0, 0]  # rows captured, placeholders, gaps, rows dropped, bytes
    stitched: dict[str, StitchedField] = {}
    for field in names:
        result = _stitch_field(trace, field, n, placeholder, on_gap, topk, counts)
        if result is None:
            return None
        stitched[field], warning = result
        if warning:
            warnings.append(warning)
    captured, placeholders, gaps, dropped, nbytes = counts
    stats = StitchStats(1, 0, captured, placeholders, gaps, dropped, 0, nbytes)
    return StitchedSample(trace.trace_id, n, stitched, stats, tuple(warnings))


def _stitch_field(
    trace: Trace,
    field: str,
    n: int,
    placeholder: Placeholder,
    on_gap: OnGap,
    topk: int | None,
    counts: list[int],
) -> tuple[StitchedField, str | None] | None:
    """One field's pieces and warning (its statistics added to ``counts``); None when the
    sample is dropped."""
    real = _window(trace.pieces.get(field, ()), n)
    spans: list[tuple[int, int]] = []
    captured = nbytes = 0
    for piece in real:
        spans += ((piece.pos, piece.end),)
        captured += piece.rows
        nbytes += piece.nbytes
    holes = complement(spans, 0, n)
    gaps = intersect(holes, trace.expected(field)) if holes else []
    warning, dropped = None, 0
    if gaps:
        message = (
            f"trace {trace.trace_id!r} field {field!r}: no rows for positions "
            f"{format_spans(gaps)} of sample [0, {n})"
        )
        if on_gap == "raise":
            raise TraceGapError(message)
        if on_gap == "drop_sample":
            logger.warning("%s; sample dropped", message)
            return None
        warning = f"{message}; every row of {field!r} is a placeholder"
        logger.warning(warning)
        dropped, real, holes = captured, [], [(0, n)]
        captured = nbytes = 0
    info = trace.info.get(field)
    sent = info is not None
    if not sent and field in trace.ragged_fields:
        info = NO_RAGGED_ROWS  # empty rows, whose dtype is no sample's
    if info is None:
        raise TraceError(
            f"trace {trace.trace_id!r} field {field!r}: no rows anywhere in the trace, so "
            f"its row shape and dtype are unknown"
        )
    routes = field == trace.routes_field
    kind = ("distinct" if gaps else placeholder) if routes else "fill"
    counts[0] += captured
    counts[1] += n - captured
    counts[2] += len(gaps)
    counts[3] += dropped
    counts[4] += nbytes
    pieces = tuple(_filled(real, n, field, kind)) if holes else tuple(real)
    stitched = StitchedField(field, pieces, info, n, topk if routes else None, sent=sent)
    return stitched, warning
