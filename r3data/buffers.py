"""Allocation of large batch buffers, recycled once nothing uses them.

Touching fresh memory costs a page fault per 4 KiB page; on virtual machines that caps the
fill of a new multi-GB batch buffer near 1 GB/s, a tenth of a memcpy. A training loop
allocates a batch of about the same size every step, so :class:`BufferPool` keeps the
mappings of batches the trainer has dropped and hands them out again, already faulted in.
A mapping is reused only when no tensor, view or numpy array of the batch is alive.
"""

from __future__ import annotations

import math
import mmap
import numbers
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from r3data.errors import ConfigError, PackedError
from r3data.validate import checked_int

POOL_MIN_BYTES = 2 << 20
"""Smaller buffers come from torch's allocator: faults are cheap there, recycling is not."""


class _Region:
    """One anonymous mapping and a weak reference to the array currently built on it."""

    __slots__ = ("in_use", "mapping")

    def __init__(self, nbytes: int) -> None:
        # private: a forked child never writes into this process's batches, and huge pages
        # follow the anonymous-memory setting (shared anonymous memory is shmem: none)
        self.mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer faults where the kernel allows
        self.in_use: weakref.ref | None = None

    @property
    def nbytes(self) -> int:
        return len(self.mapping)

    @property
    def free(self) -> bool:
        return self.in_use is None or self.in_use() is None

    def array(self, nbytes: int) -> np.ndarray:
        array = np.frombuffer(self.mapping, dtype=np.uint8, count=nbytes)
        self.in_use = weakref.ref(array)
        return array


class BufferPool:
    """Hands out CPU tensors backed by recycled mappings.

    A request takes the smallest free mapping of at least its size and at most twice it;
    otherwise a new mapping (rounded up by ``slack``) is made. At most ``max_free`` free
    mappings are kept; older ones are unmapped.
    """

    def __init__(self, max_free: int = 2, slack: float = 1.125) -> None:
        self.max_free = checked_int("BufferPool max_free", max_free)
        # a mapping must hold its request, and a request reuses mappings of at most twice it
        if isinstance(slack, bool) or not isinstance(slack, numbers.Real) or not 1 <= slack <= 2:
            raise ConfigError(f"BufferPool slack: expected a number in [1, 2], found {slack!r:.40}")
        self.slack = slack
        self._regions: list[_Region] = []
        self._lock = threading.Lock()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` (contents are whatever the last batch left)."""
        shape = _shape(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < POOL_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            region = self._take(nbytes)
            array = region.array(nbytes)
        return torch.from_numpy(array).view(dtype).view(shape)

    def _take(self, nbytes: int) -> _Region:
        fits = [r for r in self._regions if r.free and nbytes <= r.nbytes <= 2 * nbytes]
        if fits:
            return min(fits, key=lambda r: r.nbytes)
        self._trim()  # before the new mapping joins: it is not free, though nothing uses it yet
        region = _Region(int(nbytes * self.slack))
        self._regions.append(region)
        return region

    def _trim(self) -> None:
        free = [r for r in self._regions if r.free]
        for region in free[: max(0, len(free) - self.max_free)]:
            self._regions.remove(region)
            region.mapping.close()

    @property
    def nbytes(self) -> int:
        """Bytes mapped by the pool, in use or free."""
        return sum(r.nbytes for r in self._regions)


def empty_rows(
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    pin_memory: bool = False,
    pool: BufferPool | None = None,
) -> torch.Tensor:
    """An uninitialised CPU tensor for a batch buffer: page-locked when asked and an
    accelerator exists, else from ``pool`` when given, else from torch's allocator."""
    shape = _shape(shape)
    if pin_memory and torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if pool is not None:
        return pool.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(checked_int("buffer shape", d, error=PackedError) for d in shape)
