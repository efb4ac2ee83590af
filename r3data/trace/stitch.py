"""``stitch``: one sample's rows per field, as pieces covering ``[0, sample_len)`` exactly.

A piece is a :class:`PayloadSegment` (read by handle) or an :class:`InlineRows` whose array is
a view of the engine's array, so a loader copies each piece once into its slice of the batch
buffer. Positions without a row get a placeholder and ``valid`` False:

- positions the engine never forwards or that the trainer appended (the last token, a synthetic
  EOS) take, for routes, a copy of the previous row (``"repeat_previous"``; by handle a one-row
  segment re-pointing at that row's bytes) or distinct experts ``arange(topk)``
  (``"distinct"``, also used where no previous row exists); for other fields a fill row
  (0, or an empty row for ragged fields), e.g. prompt tokens, which have no sampling mask;
- positions where the engine should have produced a row but did not are a gap, handled by
  ``on_gap``: ``"drop_routes"`` makes every row of that field a placeholder (all invalid, with a
  warning), ``"drop_sample"`` returns None, ``"raise"`` raises :class:`TraceGapError`.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np

from r3data.errors import ConfigError, TraceError, TraceGapError
from r3data.payload.segment import PayloadSegment
from r3data.trace.builder import ROUTES_FIELD, FieldInfo, Source, Trace, TraceBuilder, clip_source
from r3data.trace.materialize import materialize_field
from r3data.trace.spans import complement, format_spans, intersect
from r3data.wire.anchors import nonnegative_int
from r3data.wire.rows import InlineRows

if TYPE_CHECKING:
    from r3data.payload.reader import PayloadReader

__all__ = [
    "PLACEHOLDER_META",
    "OnGap",
    "Placeholder",
    "StitchStats",
    "StitchedField",
    "StitchedSample",
    "distinct_row",
    "stitch",
]

Placeholder = Literal["repeat_previous", "distinct"]
OnGap = Literal["drop_routes", "drop_sample", "raise"]

PLACEHOLDER_META = "placeholder"
"""Key of ``InlineRows.meta`` naming the kind of an inline placeholder piece."""

logger = logging.getLogger("r3data.trace")


@dataclass(frozen=True)
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
    bytes: int = 0
    """Bytes of captured rows as the engine stored them (a ragged handle: its index table)."""

    def __add__(self, other: StitchStats) -> StitchStats:
        return StitchStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @classmethod
    def total(cls, samples: Iterable[StitchedSample | None]) -> StitchStats:
        """Batch statistics; a None (a sample dropped by ``on_gap="drop_sample"``) counts as
        one dropped sample."""
        out = cls()
        for sample in samples:
            out += cls(samples=1, samples_dropped=1) if sample is None else sample.stats
        return out


@dataclass(frozen=True, eq=False)
class StitchedField:
    """One field of a sample: ``pieces`` in position order, covering ``[0, len(valid))``."""

    name: str
    pieces: tuple[Source, ...]
    valid: np.ndarray
    dtype: np.dtype
    row_shape: tuple[int, ...]
    ragged: bool


@dataclass(frozen=True, eq=False)
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

    def materialize(self, field: str, reader: PayloadReader | None = None) -> np.ndarray:
        """The field as one array ``[sample_len, *row_shape]`` (ragged: padded with -1);
        by-handle pieces are read through ``reader``."""
        return materialize_field(self.fields[field], self.sample_len, reader, self.trace_id)


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
    inside = list(pieces[: bisect_left(pieces, n, key=lambda p: p.pos)])
    if inside and inside[-1].end > n:
        inside[-1] = clip_source(inside[-1], inside[-1].pos, n)
    return inside


class _Filler:
    """Placeholder pieces for one field."""

    def __init__(self, field: str, info: FieldInfo, kind: str, topk: int | None) -> None:
        self.field, self.info, self.kind, self.topk = field, info, kind, topk

    def pieces(self, lo: int, hi: int, previous: Source | None) -> list[Source]:
        if self.kind == "repeat_previous" and previous is not None:
            if isinstance(previous, PayloadSegment):
                last = clip_source(previous, previous.end - 1, previous.end)
                return [replace(last, pos=p) for p in range(lo, hi)]
            row = previous.array[-1]
            return [self._inline(np.broadcast_to(row, (hi - lo, *row.shape)), lo, self.kind)]
        if self.kind == "fill":
            shape = (0,) if self.info.ragged else self.info.row_shape
            row = np.zeros(shape, dtype=self.info.dtype)
            return [self._inline(np.broadcast_to(row, (hi - lo, *shape)), lo, "fill")]
        row = distinct_row(self.info.row_shape, self.info.dtype, self.topk)
        return [self._inline(np.broadcast_to(row, (hi - lo, *row.shape)), lo, "distinct")]

    def _inline(self, array: np.ndarray, pos: int, kind: str) -> InlineRows:
        return InlineRows(self.field, array, pos, {PLACEHOLDER_META: kind})


def _filled(real: list[Source], n: int, filler: _Filler) -> list[Source]:
    """``real`` pieces with placeholders in every hole of ``[0, n)``, in position order."""
    out: list[Source] = []
    cursor = 0
    previous: Source | None = None
    for piece in real:
        if piece.pos > cursor:
            out.extend(filler.pieces(cursor, piece.pos, previous))
        out.append(piece)
        cursor, previous = piece.end, piece
    if cursor < n:
        out.extend(filler.pieces(cursor, n, previous))
    return out


def _placeholder_kind(routes: bool, placeholder: Placeholder, *, dropped: bool) -> str:
    """Routes follow ``placeholder`` (distinct once dropped: no row is left to repeat); other
    fields are filled."""
    if not routes:
        return "fill"
    return "distinct" if dropped else placeholder


def _nbytes(piece: Source) -> int:
    return piece.nbytes if isinstance(piece, PayloadSegment) else piece.array.nbytes


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
    if placeholder not in ("repeat_previous", "distinct"):
        raise ConfigError(
            f"placeholder: expected 'repeat_previous' or 'distinct', found {placeholder!r}"
        )
    if on_gap not in ("drop_routes", "drop_sample", "raise"):
        raise ConfigError(
            f"on_gap: expected 'drop_routes', 'drop_sample' or 'raise', found {on_gap!r}"
        )
    if topk is not None and nonnegative_int("topk", topk) == 0:
        raise ConfigError("topk: expected an int >= 1, found 0")
    names = [fields] if isinstance(fields, str) else list(fields)
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"fields: expected distinct field names, found {names!r}")
    warnings = list(trace.warnings)
    stats = StitchStats(samples=1)
    stitched: dict[str, StitchedField] = {}
    for field in names:
        result = _stitch_field(trace, field, n, placeholder, on_gap, topk)
        if result is None:
            return None
        stitched[field], field_stats, warning = result
        stats += field_stats
        warnings.extend([warning] if warning else [])
    return StitchedSample(
        trace_id=trace.trace_id,
        sample_len=n,
        fields=MappingProxyType(stitched),
        stats=stats,
        warnings=tuple(warnings),
    )


def _stitch_field(
    trace: Trace, field: str, n: int, placeholder: Placeholder, on_gap: OnGap, topk: int | None
) -> tuple[StitchedField, StitchStats, str | None] | None:
    """One field's pieces, statistics and warning; None when the sample is dropped."""
    real = _window(trace.pieces.get(field, ()), n)
    gaps = intersect(complement([(p.pos, p.end) for p in real], 0, n), trace.expected(field))
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
        dropped, real = sum(p.rows for p in real), []
    info = trace.info.get(field)
    if info is None:
        raise TraceError(
            f"trace {trace.trace_id!r} field {field!r}: no rows anywhere in the trace, so "
            f"its row shape and dtype are unknown"
        )
    kind = _placeholder_kind(field == trace.routes_field, placeholder, dropped=bool(gaps))
    valid = np.zeros(n, dtype=bool)
    for piece in real:
        valid[piece.pos : piece.end] = True
    captured = sum(p.rows for p in real)
    stats = StitchStats(
        rows_captured=captured,
        placeholders=n - captured,
        gaps=len(gaps),
        rows_dropped=dropped,
        bytes=sum(_nbytes(p) for p in real),
    )
    pieces = tuple(_filled(real, n, _Filler(field, info, kind, topk)))
    return (
        StitchedField(field, pieces, valid, info.dtype, info.row_shape, info.ragged),
        stats,
        warning,
    )
