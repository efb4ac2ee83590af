"""``Segmented``: what every packed batch type shares: B samples laid end to end, sample i
holding rows ``offsets[i]:offsets[i + 1]`` (host int64 offsets, validated by the type).

Indexing, lengths and repeats are defined once here; a type gives its ``segment`` (one
sample), ``_view`` (a contiguous run of samples, no copy) and ``gather`` (a copy of any)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from r3data.errors import PackedError, PackedIndexError
from r3data.validate import checked_int, slice_bounds

__all__ = ["Segmented", "check_count", "pick_indices"]


class Segmented:
    """B samples end to end by host offsets (see the module doc)."""

    __slots__ = ()
    _offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Rows per sample, on the host (int64, B)."""
        return np.diff(self._offsets)

    @property
    def total_rows(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self._offsets.size - 1

    def _sample(self, i: int) -> int:
        """``i`` as a position in ``range(B)`` (negative counts from the end), checked."""
        batch = len(self)
        if not -batch <= i < batch:
            raise PackedIndexError(f"segment index must be in [-{batch}, {batch}), found {i}")
        return i % batch

    def __getitem__(self, index: Any) -> Any:
        """An int gives one sample's rows; a contiguous slice a view; anything else a gather."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            return self.segment(int(index))
        if isinstance(index, slice):
            start, stop, step = slice_bounds(index, len(self), error=PackedIndexError)
            if step == 1:
                return self._view(start, max(start, stop))
            return self.gather(np.arange(start, stop, step))
        return self.gather(index)

    def repeat_interleave(self, n: int) -> Any:
        """Repeat each sample ``n`` times in place: B*n samples."""
        check_count(n)
        return self.gather(np.repeat(np.arange(len(self)), n))

    def segment(self, i: int) -> Any:
        raise NotImplementedError

    def _view(self, start: int, stop: int) -> Any:
        raise NotImplementedError

    def gather(self, index: Any) -> Any:
        raise NotImplementedError


def pick_indices(index: Any, batch: int) -> np.ndarray:
    """Positions in ``range(batch)`` picked by an index list or a boolean mask, validated."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    try:
        picks = np.asarray(index)
    except ValueError:  # rows of different lengths
        picks = np.asarray(index, dtype=object)
    if picks.dtype == np.bool_:
        if picks.shape != (batch,):
            raise PackedError(f"boolean mask must have shape ({batch},), found {picks.shape}")
        return np.flatnonzero(picks)
    if picks.size == 0:
        return np.zeros(0, dtype=np.int64)
    if picks.dtype.kind not in "iu" or picks.ndim != 1:
        raise PackedError(
            f"index must be a 1-D list of ints or a boolean mask, found dtype {picks.dtype} "
            f"and shape {picks.shape}"
        )
    if picks.min() < -batch or picks.max() >= batch:
        bad = int(picks.min()) if picks.min() < -batch else int(picks.max())
        raise PackedIndexError(f"index must be in [-{batch}, {batch}), found {bad}")
    return picks.astype(np.int64) % max(batch, 1)


def check_count(n: int) -> None:
    checked_int("repeat count", n, error=PackedError)
