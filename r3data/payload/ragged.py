"""Intake of the fields a writer is given: host arrays, and ragged rows in any of their forms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from r3data.errors import SegmentError, WireFormatError
from r3data.ragged import RaggedRows
from r3data.wire.dtypes import parse_dtype

__all__ = ["as_ragged", "host_array"]


def host_array(data: Any, what: str) -> np.ndarray:
    """``data`` (numpy, a CPU torch tensor, anything array-like) as a C-contiguous little-endian
    array of an allowed dtype."""
    try:
        array = np.asarray(data)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SegmentError(
            f"{what}: expected a host array, found {type(data).__name__}: {exc}"
        ) from None
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    try:
        dtype = parse_dtype(dtype)
    except WireFormatError as exc:
        raise SegmentError(f"{what}: {exc}") from None
    return np.asarray(array, dtype=dtype, order="C")


def as_ragged(data: RaggedRows | tuple[Any, Any] | Sequence[Any], what: str) -> RaggedRows:
    """Ragged rows given as :class:`RaggedRows`, ``(values, row_lengths)`` or a list of 1-D
    arrays, checked; the result's offsets start at 0."""
    if isinstance(data, RaggedRows):
        values, offsets = data.compact()
        return RaggedRows(host_array(values, f"{what} values"), offsets, what=what)
    if isinstance(data, tuple):
        if len(data) != 2:
            raise SegmentError(
                f"{what}: ragged rows as a tuple must be (values, row_lengths), found {len(data)} "
                "items"
            )
        values = host_array(data[0], f"{what} values")
        lengths = host_array(data[1], f"{what} row_lengths")
    else:
        rows = [host_array(row, f"{what} row {i}") for i, row in enumerate(data)]
        dtypes = {row.dtype for row in rows}
        if len(dtypes) > 1:
            raise SegmentError(
                f"{what}: ragged rows must share one dtype, found {sorted(map(str, dtypes))}"
            )
        dtype = dtypes.pop() if dtypes else np.dtype("<i4")
        bad = next((i for i, row in enumerate(rows) if row.ndim != 1), None)
        if bad is not None:
            raise SegmentError(
                f"{what}: ragged row {bad} must be 1-D, found shape {rows[bad].shape}"
            )
        values = np.concatenate(rows) if rows else np.empty(0, dtype)
        lengths = np.array([row.size for row in rows], dtype=np.int64)
    if values.ndim != 1:
        raise SegmentError(f"{what}: ragged values must be 1-D, found shape {values.shape}")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise SegmentError(
            f"{what}: row_lengths must be a 1-D integer array, found {lengths.dtype} "
            f"{lengths.shape}"
        )
    lengths = lengths.astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise SegmentError(f"{what}: row_lengths must be >= 0, found {int(lengths.min())}")
    if lengths.size and lengths.max() > values.size:  # else their sum may wrap around int64
        raise SegmentError(
            f"{what}: row_lengths: expected each <= the {values.size} values, found "
            f"{int(lengths.max())}"
        )
    if int(lengths.sum()) != values.size:
        raise SegmentError(
            f"{what}: row_lengths sum to {int(lengths.sum())}, values hold {values.size} elements"
        )
    return RaggedRows.from_lengths(values, lengths, what=what)
