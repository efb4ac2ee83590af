"""``TraceBuilder``: the rows of a multi-turn conversation, request by request.

Each request brings rows for a span of positions, inline (:class:`InlineRows`) or by handle
(:class:`PayloadSegment`). The builder keeps, per field, non-overlapping pieces ordered by
position; a later request wins where spans overlap (within one request, sources of a field
must not overlap: that is ambiguous, e.g. every choice of a multi-choice response). Adding a
source cuts at most the pieces it overlaps (views and re-pointed handles, never copies), so a
whole trace costs O(total rows): earlier turns are never re-gathered.
"""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np

from r3data.errors import ConfigError, TraceError
from r3data.payload.segment import PayloadSegment
from r3data.trace.checks import (
    check_expert_ids,
    check_row_shape,
    nonzero_runs,
    widened_dtype,
    zero_rows,
)
from r3data.trace.spans import Span, complement, format_spans, merge
from r3data.wire.anchors import nonnegative_int, routes_end
from r3data.wire.dtypes import ROUTE_DTYPES, parse_dtype
from r3data.wire.rows import InlineRows

__all__ = ["ROUTES_FIELD", "FieldInfo", "Source", "Trace", "TraceBuilder", "clip_source"]

ROUTES_FIELD = "routed_experts"

Source = InlineRows | PayloadSegment
ZeroRows = Literal["missing", "raise", "keep"]

logger = logging.getLogger("r3data.trace")


def clip_source(source: Source, lo: int, hi: int) -> Source:
    """The rows of ``source`` at positions ``[lo, hi)`` (inside its span): a view or a handle."""
    if isinstance(source, PayloadSegment):
        part = source.clipped(lo, hi)
        if part is None:
            raise TraceError(
                f"field {source.field!r}: cannot clip rows [{source.pos}, {source.end}) to "
                f"the empty range [{lo}, {hi})"
            )
        return part
    if (lo, hi) == (source.pos, source.end):
        return source
    return InlineRows(
        source.field, source.array[lo - source.pos : hi - source.pos], lo, source.meta
    )


@dataclass(frozen=True)
class FieldInfo:
    """What a trace knows of one field's rows: the widest dtype seen and the row shape."""

    dtype: np.dtype
    row_shape: tuple[int, ...]
    ragged: bool


@dataclass(frozen=True)
class Trace:
    """A snapshot of a trace: per field, pieces ordered by position that never overlap."""

    trace_id: str
    routes_field: str
    requests: tuple[tuple[int, int], ...]
    pieces: Mapping[str, tuple[Source, ...]]
    info: Mapping[str, FieldInfo]
    warnings: tuple[str, ...] = ()

    def expected(self, field: str) -> list[Span]:
        """Ranges where the engine should have produced rows of ``field``, merged and ordered:
        every forwarded token for routes, every completion token for other fields."""
        if field == self.routes_field:
            return merge((0, routes_end(p, c)) for p, c in self.requests)
        return merge((p, p + c) for p, c in self.requests)


class _Track:
    """One field's pieces, ordered by position, non-overlapping."""

    __slots__ = ("pieces", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.pieces: list[Source] = []

    def put(self, piece: Source) -> None:
        """Insert ``piece``, trimming or removing the pieces it overlaps (it wins)."""
        lo, hi = piece.pos, piece.end
        first = bisect_right(self.starts, lo) - 1
        if first < 0 or self.pieces[first].end <= lo:
            first += 1
        stop = bisect_left(self.starts, hi)
        replacement: list[Source] = []
        if first < stop:
            head, tail = self.pieces[first], self.pieces[stop - 1]
            if head.pos < lo:
                replacement.append(clip_source(head, head.pos, lo))
            replacement.append(piece)
            if tail.end > hi:
                replacement.append(clip_source(tail, hi, tail.end))
        else:
            replacement.append(piece)
        self.pieces[first:stop] = replacement
        self.starts[first:stop] = [p.pos for p in replacement]


def _rows_of(source: Source) -> tuple[np.dtype, tuple[int, ...], bool]:
    if isinstance(source, PayloadSegment):
        return parse_dtype(source.dtype), source.shape, source.ragged
    return source.array.dtype, source.row_shape, False


class TraceBuilder:
    """Collects the requests of one trace; :meth:`build` gives an immutable :class:`Trace`.

    ``routes_field`` rows are anchored on forwarded tokens, so they end by the last one (see
    :mod:`r3data.wire.anchors`; ``last_token_row`` also admits a row for the last token, which
    vLLM, SGLang and prime-rl never send); every other field sits on completion tokens. Fields
    in ``ragged_fields`` hold rows of varying width (sampling masks: inline padded with -1, by
    handle with an index table). Inline routes are checked on arrival: ids below
    ``num_experts`` when given, and rows that are 0 in every entry (an engine bug) are, per
    ``zero_rows``, treated as missing (logged), refused, or kept. Bad option values raise
    :class:`ConfigError`; rows that do not fit raise :class:`TraceError`.
    """

    def __init__(
        self,
        trace_id: str = "",
        *,
        num_experts: int | None = None,
        routes_field: str = ROUTES_FIELD,
        ragged_fields: Iterable[str] = ("sampling_mask",),
        zero_rows: ZeroRows = "missing",
        last_token_row: bool = False,
    ) -> None:
        if zero_rows not in ("missing", "raise", "keep"):
            raise ConfigError(
                f"zero_rows: expected 'missing', 'raise' or 'keep', found {zero_rows!r}"
            )
        if num_experts is not None and nonnegative_int("num_experts", num_experts) == 0:
            raise ConfigError("num_experts: expected an int >= 1, found 0")
        if not isinstance(last_token_row, bool):
            raise ConfigError(f"last_token_row: expected a bool, found {last_token_row!r}")
        self.trace_id = str(trace_id)
        self.num_experts = num_experts
        self.routes_field = routes_field
        self.ragged_fields = frozenset(ragged_fields)
        self.zero_rows = zero_rows
        self.last_token_row = last_token_row
        self._requests: list[tuple[int, int]] = []
        self._tracks: dict[str, _Track] = {}
        self._info: dict[str, FieldInfo] = {}
        self._warnings: list[str] = []

    def add_request(
        self, prompt_len: int, completion_len: int, sources: Iterable[Source] = ()
    ) -> None:
        """Add one request's rows; ``sources`` carry their own positions. Validates every
        source before changing anything, so a refused request leaves the trace as it was."""
        prompt_len = nonnegative_int("prompt_len", prompt_len, TraceError)
        completion_len = nonnegative_int("completion_len", completion_len, TraceError)
        request_sources = list(sources)
        for source in request_sources:
            if not isinstance(source, (InlineRows, PayloadSegment)):
                raise TraceError(
                    f"trace {self.trace_id!r}: expected InlineRows or PayloadSegment sources, "
                    f"found {type(source).__name__}"
                )
            self._check_span(source, prompt_len, completion_len)
        self._check_disjoint(request_sources)
        info = dict(self._info)
        pieces: list[Source] = []
        warnings: list[str] = []
        for source in request_sources:
            info[source.field] = self._merged_info(info.get(source.field), source)
            if source.rows:
                pieces.extend(self._checked(source, warnings))
        self._requests.append((prompt_len, completion_len))
        self._info = info
        for piece in pieces:
            self._tracks.setdefault(piece.field, _Track()).put(piece)
        for message in warnings:
            logger.warning(message)
        self._warnings.extend(warnings)

    def _check_span(self, source: Source, prompt_len: int, completion_len: int) -> None:
        """Routes end by the last forwarded token (or the last token with
        ``last_token_row``); any other field by the last token."""
        tokens = prompt_len + completion_len
        lengths = f"prompt_len {prompt_len} + completion_len {completion_len}"
        if source.end > tokens:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: rows cover positions "
                f"[{source.pos}, {source.end}), past the {tokens} tokens of this request "
                f"({lengths})"
            )
        if source.field == self.routes_field and source.end > routes_end(
            prompt_len, completion_len, last_token_row=self.last_token_row
        ):
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected routes ending by "
                f"position {tokens - 1} ({lengths} - 1: the last token is never forwarded), "
                f"found rows for [{source.pos}, {source.end}) (shifted by +1?); pass "
                f"last_token_row=True for an engine that sends a row for the last token"
            )

    def _check_disjoint(self, sources: list[Source]) -> None:
        """Sources of one field in one request must not overlap: which would win?"""
        spans: dict[str, list[tuple[int, int]]] = {}
        for source in sources:
            if source.rows:
                spans.setdefault(source.field, []).append((source.pos, source.end))
        for field, field_spans in spans.items():
            field_spans.sort()
            for (lo, hi), (next_lo, next_hi) in itertools.pairwise(field_spans):
                if next_lo < hi:
                    raise TraceError(
                        f"trace {self.trace_id!r} field {field!r}: sources of one request "
                        f"overlap, [{lo}, {hi}) and [{next_lo}, {next_hi}) (several choices "
                        f"of one response?); expected disjoint ranges, one source per position"
                    )

    def _merged_info(self, known: FieldInfo | None, source: Source) -> FieldInfo:
        dtype, row_shape, handle_ragged = _rows_of(source)
        where = {"trace_id": self.trace_id, "field": source.field, "pos": source.pos}
        ragged = handle_ragged or source.field in self.ragged_fields
        if known is not None and known.ragged != ragged:
            if not known.ragged:
                raise TraceError(
                    f"trace {self.trace_id!r} field {source.field!r}: ragged rows at position "
                    f"{source.pos} after fixed-width rows of shape {list(known.row_shape)}"
                )
            ragged = True  # padded inline rows of a field earlier sent ragged by handle
        if source.field == self.routes_field and dtype not in ROUTE_DTYPES:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected route dtype one of "
                f"{[d.name for d in ROUTE_DTYPES]}, found {dtype} at position {source.pos}"
            )
        if ragged and isinstance(source, InlineRows) and source.array.ndim != 2:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected ragged rows padded "
                f"2-D [rows, width] with -1, found shape {list(source.array.shape)} at position "
                f"{source.pos}"
            )
        if known is None:
            return FieldInfo(
                dtype, check_row_shape(None, row_shape, ragged=ragged, **where), ragged
            )
        return FieldInfo(
            widened_dtype(known.dtype, dtype, **where),
            check_row_shape(known.row_shape, row_shape, ragged=known.ragged, **where),
            known.ragged,
        )

    def _checked(self, source: Source, warnings: list[str]) -> list[Source]:
        """``source`` split around rows to treat as missing, after the route checks."""
        if source.field != self.routes_field or not isinstance(source, InlineRows):
            return [source]
        if self.num_experts is not None:
            check_expert_ids(
                source.array,
                self.num_experts,
                trace_id=self.trace_id,
                field=source.field,
                pos=source.pos,
            )
        if self.zero_rows == "keep":
            return [source]
        zero = zero_rows(source.array)
        if not zero.any():
            return [source]
        runs = nonzero_runs(zero)
        missing = complement(
            [(source.pos + a, source.pos + b) for a, b in runs], source.pos, source.end
        )
        message = (
            f"trace {self.trace_id!r} field {source.field!r}: {int(zero.sum())} all-zero route "
            f"rows (an engine bug) at positions {format_spans(missing)}"
        )
        if self.zero_rows == "raise":
            raise TraceError(message)
        warnings.append(message + "; treated as missing")
        return [clip_source(source, source.pos + a, source.pos + b) for a, b in runs]

    def build(self) -> Trace:
        """An immutable snapshot of the trace so far."""
        return Trace(
            trace_id=self.trace_id,
            routes_field=self.routes_field,
            requests=tuple(self._requests),
            pieces=MappingProxyType({f: tuple(t.pieces) for f, t in self._tracks.items()}),
            info=MappingProxyType(dict(self._info)),
            warnings=tuple(self._warnings),
        )
