"""Validation hooks for rows entering a trace: expert ids, all-zero rows, dtype and width.

They run once per source when it is added (inline rows) and are public so a loader can run the
row checks on by-handle rows after reading them.
"""

from __future__ import annotations

import numpy as np

from r3data.errors import TraceError

__all__ = ["check_expert_ids", "check_row_shape", "nonzero_runs", "widened_dtype", "zero_rows"]


def _where(trace_id: str, field: str) -> str:
    return f"trace {trace_id!r} field {field!r}"


def check_expert_ids(
    array: np.ndarray, num_experts: int, *, trace_id: str, field: str, pos: int
) -> None:
    """Raise :class:`TraceError` unless every expert id of ``array`` (rows from ``pos``) is in
    ``[0, num_experts)``; the message names the first offending position, layer and id."""
    if array.dtype.kind not in "iu":
        raise TraceError(
            f"{_where(trace_id, field)}: expected integer expert ids, found dtype {array.dtype}"
        )
    if array.size == 0 or (array.max() < num_experts and array.min() >= 0):
        return
    flat = array.reshape(array.shape[0], -1)
    bad = (flat >= num_experts) | (flat < 0)
    row, column = np.unravel_index(int(np.argmax(bad)), bad.shape)
    layer = column // array.shape[-1] if array.ndim > 2 else 0
    raise TraceError(
        f"{_where(trace_id, field)}: expected expert ids in [0, {num_experts}), found "
        f"{int(flat[row, column])} at position {pos + int(row)} (layer {int(layer)})"
    )


def zero_rows(array: np.ndarray) -> np.ndarray:
    """Boolean ``[rows]``: rows whose every entry is 0 (an engine bug for MoE routes)."""
    return ~array.reshape(array.shape[0], -1).any(axis=1)


def nonzero_runs(zero: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, stop)`` of row indices where ``zero`` is False."""
    keep = np.concatenate(([False], ~zero, [False]))
    edges = np.flatnonzero(keep[1:] != keep[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _family(dtype: np.dtype) -> str:
    return "integer" if dtype.kind in "iu" else dtype.kind


def widened_dtype(
    current: np.dtype | None, found: np.dtype, *, trace_id: str, field: str, pos: int
) -> np.dtype:
    """The dtype holding both ``current`` and ``found`` without loss (e.g. uint8 + uint16 ->
    uint16; never narrower than either); :class:`TraceError` when neither holds the other."""
    if current is None or found == current:
        return found
    if _family(found) == _family(current):
        if np.can_cast(found, current, "safe"):
            return current
        if np.can_cast(current, found, "safe"):
            return found
    raise TraceError(
        f"{_where(trace_id, field)}: rows from position {pos} have dtype {found}, which does "
        f"not widen to or from the dtype {current} of earlier rows "
        f"(allowed: uint8 -> uint16 -> int32 -> int64)"
    )


def check_row_shape(
    expected: tuple[int, ...] | None,
    found: tuple[int, ...],
    *,
    ragged: bool,
    trace_id: str,
    field: str,
    pos: int,
) -> tuple[int, ...]:
    """The field's row shape after adding rows of shape ``found``; :class:`TraceError` on a
    mismatch. Ragged fields (rows padded to varying widths inline, shape ``()`` by handle)
    keep their widest width."""
    if expected is None:
        return found
    if ragged and len(found) <= 1 and len(expected) <= 1:
        width = max((*found, *expected, 0))
        return (width,) if found or expected else ()
    if found != expected:
        raise TraceError(
            f"{_where(trace_id, field)}: rows from position {pos} have row shape {list(found)}, "
            f"expected {list(expected)} as in earlier rows"
        )
    return expected
