"""One stitched field as one array: what a loader does per piece, written out for tests and
users. Inline pieces are copied into their slice; by-handle pieces are read straight into it
(``read_many``) when their dtype is the field's, else read and widened."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from r3data.errors import TraceError
from r3data.payload.segment import PayloadSegment
from r3data.wire.masks import MASK_FILL, csr_to_padded
from r3data.wire.rows import InlineRows

if TYPE_CHECKING:
    from r3data.payload.reader import PayloadReader
    from r3data.trace.stitch import StitchedField

__all__ = ["materialize_field"]


def materialize_field(
    stitched: StitchedField, sample_len: int, reader: PayloadReader | None, trace_id: str
) -> np.ndarray:
    """``stitched`` as ``[sample_len, *row_shape]`` (ragged: ``[sample_len, widest]`` padded
    with :data:`~r3data.wire.MASK_FILL`)."""
    handles = [p for p in stitched.pieces if isinstance(p, PayloadSegment)]
    if handles and reader is None:
        raise TraceError(
            f"trace {trace_id!r} field {stitched.name!r}: {len(handles)} pieces are by handle; "
            f"pass a payload reader to materialize them"
        )
    if stitched.ragged:
        return _materialize_ragged(stitched, sample_len, reader, handles)
    out = np.empty((sample_len, *stitched.row_shape), dtype=stitched.dtype)
    same = [p for p in handles if np.dtype(p.dtype) == stitched.dtype]
    if same:
        reader.read_many([([p], out[p.pos : p.end]) for p in same])
    for piece in stitched.pieces:
        if isinstance(piece, InlineRows):
            out[piece.pos : piece.end] = piece.array
        elif np.dtype(piece.dtype) != stitched.dtype:
            out[piece.pos : piece.end] = reader.read([piece])[piece.field]
    return out


def _materialize_ragged(
    stitched: StitchedField,
    sample_len: int,
    reader: PayloadReader | None,
    handles: list[PayloadSegment],
) -> np.ndarray:
    from_handles = None
    if handles:
        read = reader.read(handles)[stitched.name]
        from_handles = csr_to_padded(read.values, read.row_lengths, what=stitched.name)
    rows: list[np.ndarray] = []
    cursor = 0
    for piece in stitched.pieces:
        if isinstance(piece, InlineRows):
            rows.append(piece.array)
        else:
            rows.append(from_handles[cursor : cursor + piece.rows])
            cursor += piece.rows
    width = max((r.shape[1] for r in rows), default=0)
    out = np.full((sample_len, width), MASK_FILL, dtype=stitched.dtype)
    for piece, array in zip(stitched.pieces, rows, strict=True):
        out[piece.pos : piece.end, : array.shape[1]] = array
    return out
