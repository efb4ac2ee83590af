"""Half-open position ranges ``(lo, hi)``: ordered, disjoint lists and their set algebra.

Shared by the trace code (which rows a segment covers) and the layout code (which positions a
rank holds).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Span", "complement", "format_spans", "intersect", "merge"]

Span = tuple[int, int]


def merge(spans: Iterable[Span]) -> list[Span]:
    """The union of ``spans`` as ordered, disjoint, non-empty ranges."""
    merged: list[Span] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def complement(spans: Iterable[Span], lo: int, hi: int) -> list[Span]:
    """Ranges of ``[lo, hi)`` outside the ordered, disjoint ``spans``."""
    out: list[Span] = []
    cursor = lo
    for start, stop in spans:
        if cursor >= hi:
            return out
        if start > cursor:
            out.append((cursor, min(start, hi)))
        cursor = max(cursor, stop)
    if cursor < hi:
        out.append((cursor, hi))
    return out


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Ranges in both ordered, disjoint lists ``a`` and ``b``."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def format_spans(spans: Iterable[Span]) -> str:
    """``[a, b), [c, d)`` for messages."""
    return ", ".join(f"[{lo}, {hi})" for lo, hi in spans)
