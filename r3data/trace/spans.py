"""Span algebra for the trace code; it lives in :mod:`r3data.spans` (layout uses it too)."""

from r3data.spans import Span, complement, format_spans, intersect, merge

__all__ = ["Span", "complement", "format_spans", "intersect", "merge"]
