"""Engines that return recognisable route rows (shared by the trace tests)."""

from __future__ import annotations

import numpy as np

from r3data.wire.rows import InlineRows


def engine_rows(turn: int, lo: int, hi: int, dtype: str = "uint8") -> np.ndarray:
    """Rows for positions ``[lo, hi)`` as request ``turn`` (>= 1) would return them:
    row p is ``[[turn, p + 1], [p + 1, turn]]``, so a row names its position and its turn."""
    p = np.arange(lo, hi) + 1
    t = np.full_like(p, turn)
    return np.stack([np.stack([t, p], -1), np.stack([p, t], -1)], 1).astype(dtype)


def routes(turn: int, lo: int, hi: int, dtype: str = "uint8") -> InlineRows:
    return InlineRows("routed_experts", engine_rows(turn, lo, hi, dtype), lo)


def materialized(sample, field: str, reader=None, **options) -> np.ndarray:
    """A stitched sample's field as one array through the loader's own fill (ragged fields
    padded with -1, as a trainer asks for them)."""
    from r3data.nodes import materialize
    from r3data.ragged import RaggedRows

    rows = materialize(sample[field], reader, **options)
    return rows.padded() if isinstance(rows, RaggedRows) else rows
