"""What both fills share (fixed-width rows, ragged rows): the result, the buffer's allocation
under a bound, claims checked against files before it, failures naming their sample."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from r3data.buffers import BufferPool, empty_rows
from r3data.errors import SegmentError
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.payload.reader import OpenFiles, PayloadReader
from r3data.trace.stitch import StitchStats
from r3data.wire.segment import PayloadSegment

__all__ = [
    "MAX_BUFFER_BYTES",
    "FilledField",
    "allocate",
    "check_sizes",
    "named",
    "naming_failures",
    "torch_dtype",
]

MAX_BUFFER_BYTES = 1 << 40
"""No field's buffer is larger than this (1 TiB): a claim above it is refused unread."""


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@dataclass
class FilledField:
    """One field of a batch: its values, which rows are engine rows, and what the screen
    changed (a statistics delta, samples to drop, warnings)."""

    values: PackedTensor | PackedRagged
    valid: np.ndarray
    stats: StitchStats = field(default_factory=StitchStats)
    dropped: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def named(exc: Exception, sample: int) -> Exception:
    """``exc`` tagged with the batch index of the sample it happened in."""
    exc.r3data_sample = sample  # type: ignore[attr-defined]
    return exc


@contextlib.contextmanager
def naming_failures(attribute: str, samples: dict[int, int]) -> Iterator[None]:
    """A failure whose ``attribute`` (the segment or range it happened in) is among
    ``samples`` (its ``id`` -> the batch index of its sample) is tagged with that sample."""
    try:
        yield
    except Exception as exc:
        failed = getattr(exc, attribute, None)
        if failed is not None and id(failed) in samples:
            named(exc, samples[id(failed)])
        raise


def check_sizes(
    reader: PayloadReader,
    segments: list[PayloadSegment],
    samples: dict[int, int],
    keep: OpenFiles | None = None,
) -> None:
    """``reader.check_sizes``; a failure names the sample of the segment that failed."""
    with naming_failures("r3data_segment", samples):
        reader.check_sizes(segments, keep)


def allocate(
    shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    name: str,
    pin_memory: bool,
    pool: BufferPool | None,
) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_BUFFER_BYTES:
        raise SegmentError(
            f"field {name!r}: its rows would take {nbytes} bytes ({list(shape)} of {dtype}), "
            f"more than the {MAX_BUFFER_BYTES} any batch buffer may"
        )
    return empty_rows(shape, torch_dtype(dtype), pin_memory=pin_memory, pool=pool)
