"""What a trace checks of the rows a source brings before reading any: dtype and width."""

from __future__ import annotations

import numpy as np

from r3data.errors import TraceError

__all__ = ["check_row_shape", "widened_dtype"]


def _where(trace_id: str, field: str) -> str:
    return f"trace {trace_id!r} field {field!r}"


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
