"""Traces: the rows of multi-turn conversations, stitched per sample.

:class:`TraceBuilder` collects each request's rows (from the wire or by handle); :func:`stitch`
cuts one sample out of the trace as a fill plan, pieces the loader copies, decodes or reads
straight into its batch buffer, with placeholders where the engine produced no row. Where a
request's route rows sit is the wire's rule (:mod:`r3data.wire.anchors`), re-exported here.
"""

from r3data.trace.builder import ROUTES_FIELD, FieldInfo, Source, Trace, TraceBuilder
from r3data.trace.checks import widened_dtype
from r3data.trace.stitch import (
    OnGap,
    Placeholder,
    PlaceholderRows,
    StitchedField,
    StitchedSample,
    StitchStats,
    distinct_row,
    stitch,
)
from r3data.wire.anchors import end_anchored_pos, start_anchored_pos

__all__ = [
    "ROUTES_FIELD",
    "FieldInfo",
    "OnGap",
    "Placeholder",
    "PlaceholderRows",
    "Source",
    "StitchStats",
    "StitchedField",
    "StitchedSample",
    "Trace",
    "TraceBuilder",
    "distinct_row",
    "end_anchored_pos",
    "start_anchored_pos",
    "stitch",
    "widened_dtype",
]
