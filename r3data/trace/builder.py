"""``TraceBuilder``: the rows of a multi-turn conversation, request by request.

Each request brings rows for a span of positions: from the wire (:class:`InlineRows`, or
:class:`EncodedRows` still base64) or by handle (:class:`PayloadSegment`). The builder keeps,
per field, non-overlapping pieces ordered by position; a later request wins where spans overlap
(within one request, sources of a field must not overlap: that is ambiguous, e.g. every choice
of a multi-choice response). Under prefill/decode disaggregation a source whose ``meta``
says ``role="decode"`` loses its rows at prompt positions, which that instance never
forwarded, so a prefill's prompt rows win whatever order the two arrive in. Adding a source
cuts at most the pieces it overlaps (views,
re-pointed handles and narrowed blobs, never copies), so a whole trace costs O(total rows):
earlier turns are never re-gathered. Nothing here reads or screens the rows themselves: the
loader's one screen does that as it fills the batch.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

import numpy as np

from r3data.errors import ConfigError, TraceError
from r3data.ragged import RaggedRows
from r3data.spans import Span, merge
from r3data.trace.checks import check_row_shape, widened_dtype
from r3data.validate import INT64_MAX, request_length
from r3data.wire.anchors import routes_end
from r3data.wire.dtypes import ROUTE_DTYPES, parse_dtype
from r3data.wire.rows import EncodedRows, InlineRows, check_route_row_shape
from r3data.wire.segment import PayloadSegment

__all__ = [
    "ROUTES_FIELD",
    "FieldInfo",
    "Source",
    "Trace",
    "TraceBuilder",
    "check_ragged_fields",
    "clip_source",
]

ROUTES_FIELD = "routed_experts"

Source = InlineRows | EncodedRows | PayloadSegment
_SOURCES = (InlineRows, EncodedRows, PayloadSegment)
_SOURCE_TYPES = frozenset(_SOURCES)
"""The source classes themselves, tested by exact type before ``isinstance``."""


def clip_source(source: Source, lo: int, hi: int) -> Source:
    """The rows of ``source`` at positions ``[lo, hi)`` (inside its span, not empty)."""
    part = source.clipped(lo, hi)
    if part is None:
        raise TraceError(
            f"field {source.field!r}: cannot clip rows [{source.pos}, {source.end}) to "
            f"the empty range [{lo}, {hi})"
        )
    return part


@dataclass(frozen=True)
class FieldInfo:
    """What a trace knows of one field's rows: the widest dtype seen and the row shape (ragged
    fields: ``()``, or the widest padded width seen by handle)."""

    dtype: np.dtype
    row_shape: tuple[int, ...]
    ragged: bool


@dataclass(frozen=True)
class Trace:
    """A snapshot of a trace: per field, pieces ordered by position that never overlap;
    ``last_token_row``: the engine sends a route row for each request's last token too;
    ``ragged_fields``: the fields whose rows vary in width (known in form without a row)."""

    trace_id: str
    routes_field: str
    requests: tuple[tuple[int, int], ...]
    pieces: Mapping[str, tuple[Source, ...]]
    info: Mapping[str, FieldInfo]
    warnings: tuple[str, ...] = ()
    last_token_row: bool = False
    ragged_fields: frozenset[str] = frozenset()
    _expected: dict[bool, list[Span]] = field(default_factory=dict, compare=False, repr=False)

    def expected(self, field: str) -> list[Span]:
        """Ranges where the engine should have produced rows of ``field``, merged and ordered:
        every forwarded token for routes (every token with ``last_token_row``), every
        completion token for other fields."""
        routes = field == self.routes_field
        spans = self._expected.get(routes)
        if spans is None:
            if routes:  # every request's routes start at 0: their union ends with the longest's
                tokens = max(map(sum, self.requests), default=0)
                end = routes_end(tokens, 0, last_token_row=self.last_token_row)
                spans = [(0, end)] if end else []
            else:
                spans = merge((p, p + c) for p, c in self.requests)
            self._expected[routes] = spans
        return spans


class _Track:
    """One field's pieces, ordered by position, non-overlapping."""

    __slots__ = ("pieces", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.pieces: list[Source] = []

    def put(self, piece: Source) -> None:
        """Insert ``piece``, trimming or removing the pieces it overlaps (it wins)."""
        lo, hi = piece.pos, piece.end
        if not self.pieces or self.pieces[-1].end <= lo:  # the usual case: a later turn
            self.starts.append(lo)
            self.pieces.append(piece)
            return
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


@lru_cache(maxsize=256)
def _first_info(dtype: np.dtype, row_shape: tuple[int, ...], ragged: bool) -> FieldInfo:
    """The info of a field's first rows (one shared instance per form: traces repeat a few)."""
    return FieldInfo(dtype, row_shape, ragged)


def _without_decode_prompt(source: Source, prompt_len: int) -> Source | None:
    """A decode instance's rows from ``prompt_len`` on (None: it has none there)."""
    meta = getattr(source, "meta", None)
    if meta is None or meta.get("role") != "decode" or source.pos >= prompt_len:
        return source
    return None if source.end <= prompt_len else clip_source(source, prompt_len, source.end)


def _kind(source: Source) -> tuple[np.dtype, tuple[int, ...], bool]:
    """``(dtype, row_shape, ragged)`` of a source as it arrived."""
    if type(source) is PayloadSegment:
        return parse_dtype(source.dtype), source.shape, source.ragged
    return source.dtype, source.row_shape, source.ragged


def check_ragged_fields(routes_field: str, ragged_fields: Iterable[str]) -> frozenset[str]:
    """``ragged_fields`` as a set, which may not hold the routes field: route rows are
    ``[layers, topk]`` ids that the screen checks, never ragged. A string is one name."""
    names = (ragged_fields,) if isinstance(ragged_fields, str) else tuple(ragged_fields)
    if routes_field in names:
        raise ConfigError(
            f"ragged_fields: expected fields other than the routes field {routes_field!r}, "
            f"found {names!r}"
        )
    return frozenset(names)


class TraceBuilder:
    """Collects the requests of one trace; :meth:`build` gives an immutable :class:`Trace`.

    ``routes_field`` rows are anchored on forwarded tokens, so they end by the last one (see
    :mod:`r3data.wire.anchors`; ``last_token_row`` is for an engine that also sends a row for
    the last token, which vLLM, SGLang and prime-rl never do: the row is admitted, and owed,
    so its absence is a gap); every other field sits on completion tokens. Fields
    in ``ragged_fields`` hold rows of varying width (sampling masks): inline as
    :class:`~r3data.ragged.RaggedRows` or padded 2-D with -1 (made ragged here, once), by
    handle with an index table or padded with -1. Bad option values raise
    :class:`ConfigError`; rows that do not fit raise :class:`TraceError`.
    """

    def __init__(
        self,
        trace_id: str = "",
        *,
        routes_field: str = ROUTES_FIELD,
        ragged_fields: Iterable[str] = ("sampling_mask",),
        last_token_row: bool = False,
    ) -> None:
        if type(last_token_row) is not bool:
            raise ConfigError(f"last_token_row: expected a bool, found {last_token_row!r}")
        self.trace_id = str(trace_id)
        self.routes_field = routes_field
        self.ragged_fields = check_ragged_fields(routes_field, ragged_fields)
        self.last_token_row = last_token_row
        self._requests: list[tuple[int, int]] = []
        self._tracks: dict[str, _Track] = {}
        self._info: dict[str, FieldInfo] = {}

    def add_request(
        self, prompt_len: int, completion_len: int, sources: Iterable[Source] = ()
    ) -> None:
        """Add one request's rows; ``sources`` carry their own positions. Validates every
        source before changing anything, so a refused request leaves the trace as it was."""
        if type(prompt_len) is not int or not 0 <= prompt_len <= INT64_MAX:
            prompt_len = request_length("prompt_len", prompt_len)
        if type(completion_len) is not int or not 0 <= completion_len <= INT64_MAX:
            completion_len = request_length("completion_len", completion_len)
        request_sources: list[Source] = []
        sources = sources if type(sources) is list else list(sources)
        for source in sources:
            if type(source) is InlineRows:
                source = self._ragged_inline(source, sources)
            if (kept := _without_decode_prompt(source, prompt_len)) is not None:
                request_sources += (kept,)
        for source in request_sources:
            if type(source) not in _SOURCE_TYPES and not isinstance(source, _SOURCES):
                raise TraceError(
                    f"trace {self.trace_id!r}: expected InlineRows, EncodedRows or "
                    f"PayloadSegment sources, found {type(source).__name__}"
                )
            self._check_span(source, prompt_len, completion_len)
            if source.field == self.routes_field and isinstance(source, PayloadSegment):
                # inline routes were held to this by their producer; a handle's is its claim
                check_route_row_shape(
                    source.shape,
                    f"trace {self.trace_id!r} field {source.field!r}: segment at position "
                    f"{source.pos}",
                    TraceError,
                )
        if len(request_sources) > 1:
            self._check_disjoint(request_sources)
        info = self._info  # copied before a change: built traces share the one they saw
        for source in request_sources:
            known = info.get(source.field)
            merged = self._merged_info(known, source)
            if merged is not known:
                info = info if info is not self._info else dict(info)
                info[source.field] = merged
        self._requests.append((prompt_len, completion_len))
        self._info = info
        for source in request_sources:
            if source.rows:
                track = self._tracks.get(source.field)
                if track is None:
                    track = self._tracks[source.field] = _Track()
                track.put(source)

    def _ragged_inline(self, source: Source, request: list[Source]) -> Source:
        """Padded inline rows of a ragged field (named ragged, or sent ragged before or by
        another source of this ``request``) as ragged rows (the one form downstream)."""
        field = source.field
        if (
            type(source) is InlineRows
            and not source.ragged
            and source.array.ndim == 2
            and (
                field in self.ragged_fields
                or (field in self._info and self._info[field].ragged)
                or any(
                    isinstance(other, _SOURCES) and other.field == field and other.ragged
                    for other in request
                )
            )
        ):
            rows = RaggedRows.from_padded(source.array, what=f"field {source.field!r}")
            return InlineRows(source.field, rows, source.pos, source.meta)
        return source

    def _check_span(self, source: Source, prompt_len: int, completion_len: int) -> None:
        """Routes end by the last forwarded token (or the last token with
        ``last_token_row``); any other field by the last token."""
        tokens = prompt_len + completion_len
        if source.end > tokens:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: rows cover positions "
                f"[{source.pos}, {source.end}), past the {tokens} tokens of this request "
                f"(prompt_len {prompt_len} + completion_len {completion_len})"
            )
        if source.field == self.routes_field and source.end > routes_end(
            prompt_len, completion_len, last_token_row=self.last_token_row
        ):
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected routes ending by "
                f"position {tokens - 1} (prompt_len {prompt_len} + completion_len "
                f"{completion_len} - 1: the last token is never forwarded), "
                f"found rows for [{source.pos}, {source.end}) (shifted by +1?); pass "
                f"last_token_row=True for an engine that sends a row for the last token"
            )

    def _check_disjoint(self, sources: list[Source]) -> None:
        """Sources of one field in one request must not overlap: which would win?"""
        spans: dict[str, list[tuple[int, int]]] = {}
        for source in sources:
            if source.rows:
                spans.setdefault(source.field, []).append((source.pos, source.end))
        for field_name, field_spans in spans.items():
            field_spans.sort()
            for (lo, hi), (next_lo, next_hi) in itertools.pairwise(field_spans):
                if next_lo < hi:
                    raise TraceError(
                        f"trace {self.trace_id!r} field {field_name!r}: sources of one request "
                        f"overlap, [{lo}, {hi}) and [{next_lo}, {next_hi}) (several choices "
                        f"of one response?); expected disjoint ranges, one source per position"
                    )

    def _merged_info(self, known: FieldInfo | None, source: Source) -> FieldInfo:
        dtype, row_shape, source_ragged = _kind(source)
        if (
            known is not None
            and known.dtype == dtype
            and known.row_shape == row_shape
            and known.ragged == source_ragged
        ):
            return known
        ragged = source_ragged or source.field in self.ragged_fields
        if known is not None and known.ragged != ragged:
            if not known.ragged:
                raise TraceError(
                    f"trace {self.trace_id!r} field {source.field!r}: ragged rows at position "
                    f"{source.pos} after fixed-width rows of shape {list(known.row_shape)}"
                )
            ragged = True  # padded rows of a field earlier sent ragged by handle
        if source.field == self.routes_field and dtype not in ROUTE_DTYPES:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected route dtype one of "
                f"{[d.name for d in ROUTE_DTYPES]}, found {dtype} at position {source.pos}"
            )
        if ragged and not source_ragged and len(row_shape) != 1:
            raise TraceError(
                f"trace {self.trace_id!r} field {source.field!r}: expected ragged rows, or rows "
                f"padded 2-D [rows, width] with -1, found row shape {list(row_shape)} at "
                f"position {source.pos}"
            )
        if known is None:
            return _first_info(dtype, row_shape, ragged)
        where = {"trace_id": self.trace_id, "field": source.field, "pos": source.pos}
        return FieldInfo(
            widened_dtype(known.dtype, dtype, **where),
            check_row_shape(known.row_shape, row_shape, ragged=known.ragged, **where),
            known.ragged,
        )

    def build(self) -> Trace:
        """An immutable snapshot of the trace so far."""
        return Trace(
            trace_id=self.trace_id,
            routes_field=self.routes_field,
            requests=tuple(self._requests),
            pieces=MappingProxyType({f: tuple(t.pieces) for f, t in self._tracks.items()}),
            info=MappingProxyType(self._info),
            last_token_row=self.last_token_row,
            ragged_fields=self.ragged_fields,
        )
