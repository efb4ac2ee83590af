"""Traces: the rows of multi-turn conversations, stitched per sample.

:class:`TraceBuilder` collects each request's rows (inline or by handle); :func:`stitch` cuts
one sample out of the trace as pieces a loader copies straight into its batch buffer, with
placeholders and a ``valid`` mask where the engine produced no row. Where a request's route
rows sit is the wire's rule (:mod:`r3data.wire.anchors`), re-exported here.
"""

from r3data.trace.builder import ROUTES_FIELD, FieldInfo, Source, Trace, TraceBuilder
from r3data.trace.checks import check_expert_ids, widened_dtype, zero_rows
from r3data.trace.stitch import (
    PLACEHOLDER_META,
    OnGap,
    Placeholder,
    StitchedField,
    StitchedSample,
    StitchStats,
    distinct_row,
    stitch,
)
from r3data.wire.anchors import end_anchored_pos, start_anchored_pos

__all__ = [
    "PLACEHOLDER_META",
    "ROUTES_FIELD",
    "FieldInfo",
    "OnGap",
    "Placeholder",
    "Source",
    "StitchStats",
    "StitchedField",
    "StitchedSample",
    "Trace",
    "TraceBuilder",
    "check_expert_ids",
    "distinct_row",
    "end_anchored_pos",
    "start_anchored_pos",
    "stitch",
    "widened_dtype",
    "zero_rows",
]
