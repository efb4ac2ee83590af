"""Fill one packed field of a batch: allocate the final buffer once, copy each piece into it.

Inline pieces are one ``memcpy`` each from the decoded wire array; by-handle pieces are read
straight into their slice of the buffer. Samples fill in parallel on the shared pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from r3data.buffers import BufferPool, empty_rows
from r3data.errors import SegmentError
from r3data.packed import PackedTensor
from r3data.parallel import fill_rows, io_workers, pool_workers
from r3data.payload.reader import PayloadReader
from r3data.payload.segment import PayloadSegment
from r3data.trace import check_expert_ids
from r3data.wire.rows import InlineRows

Piece = InlineRows | PayloadSegment
HandleCheck = Callable[[int, PayloadSegment, np.ndarray], None]
"""``check(sample, segment, rows)`` validates (and may repair) rows read by handle; inline
rows were checked when their trace was built."""


def _casting(id_limit: int | None) -> str:
    return "safe" if id_limit is None else "unsafe"  # unsafe: only after the ids were checked


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _fill_sample(
    field: str,
    sample: int,
    pieces: Sequence[Piece],
    out: np.ndarray,
    reader: PayloadReader | None,
    check: HandleCheck | None,
    id_limit: int | None,
) -> None:
    """Copy or read ``pieces`` back to back into ``out`` (one sample's slice)."""
    cursor = 0
    direct: list[tuple[list[PayloadSegment], np.ndarray]] = []
    widened: list[tuple[PayloadSegment, np.ndarray]] = []
    for piece in pieces:
        if piece.row_shape != out.shape[1:]:
            raise SegmentError(
                f"field {field!r}: expected rows of shape {out.shape[1:]}, found "
                f"{piece.row_shape} at position {piece.pos}"
            )
        target = out[cursor : cursor + piece.rows]
        cursor += piece.rows
        if isinstance(piece, InlineRows):
            if id_limit is not None and piece.array.dtype != out.dtype:
                check_expert_ids(
                    piece.array, id_limit, trace_id="inline", field=field, pos=piece.pos
                )
            np.copyto(target, piece.array, casting=_casting(id_limit))
        elif reader is None:
            raise SegmentError(f"field {field!r}: a by-handle piece needs a payload reader")
        elif np.dtype(piece.dtype) == out.dtype:
            direct.append(([piece], target))
        else:  # a turn of another dtype than the batch: read, check, then convert
            widened.append((piece, target))
    if reader is None:
        return
    staged = [np.empty((p.rows, *out.shape[1:]), dtype=p.dtype) for p, _ in widened]
    reader.read_many(direct + [([p], s) for (p, _), s in zip(widened, staged, strict=True)])
    if check is not None:
        for segments, target in direct:
            check(sample, segments[0], target)
        for (segment, _), array in zip(widened, staged, strict=True):
            check(sample, segment, array)
    for (_, target), array in zip(widened, staged, strict=True):
        np.copyto(target, array, casting=_casting(id_limit))


def pack_field(
    field: str,
    pieces: Sequence[Sequence[Piece]],
    *,
    row_shape: Sequence[int],
    dtype: np.dtype,
    reader: PayloadReader | None = None,
    workers: int | None = None,
    pin_memory: bool = False,
    pool: BufferPool | None = None,
    check: HandleCheck | None = None,
    id_limit: int | None = None,
) -> PackedTensor:
    """One ``PackedTensor`` whose segment i holds sample i's pieces back to back.

    ``reader`` reads by-handle pieces straight into the buffer and ``check`` validates what
    it read. The buffer comes from ``pool`` when given (a recycled buffer fills at memcpy
    speed). With ``id_limit``, pieces of another dtype than ``dtype`` are narrowed once their
    ids are known to be below it (inline pieces are checked here, by-handle ones by
    ``check``). Failures carry the sample index (``exc.r3data_index``). ``workers`` defaults
    to the I/O worker count when any piece is by handle, else to the CPU worker count.
    """
    lengths = np.array([sum(p.rows for p in sample) for sample in pieces], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    shape = (int(offsets[-1]), *row_shape)
    values = empty_rows(shape, torch_dtype(np.dtype(dtype)), pin_memory=pin_memory, pool=pool)
    out = values.numpy()
    if workers is None:
        by_handle = any(isinstance(p, PayloadSegment) for sample in pieces for p in sample)
        workers = io_workers() if by_handle else pool_workers()
    fill_rows(
        lambda i: _fill_sample(
            field,
            i,
            pieces[i],
            out[offsets[i] : offsets[i + 1]],
            reader,
            check,
            id_limit,
        ),
        len(pieces),
        workers,
    )
    return PackedTensor(values, offsets)
