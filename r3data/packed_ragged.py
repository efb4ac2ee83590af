"""``PackedRagged``: the ragged rows (CSR) of a batch's B samples, back to back.

It is a :class:`~r3data.packed.PackedTensor` whose segments are the rows (values: every id;
``cu_seqlens``: the row offsets) plus the samples' offsets in rows, so every batch operation
(gather, cat, to, pin_memory, pickling) is the packed tensor's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from r3data.errors import PackedError
from r3data.packed import PackedTensor, aranges
from r3data.ragged import (
    DEFAULT_MAX_CELLS,
    MASK_FILL,
    RaggedRows,
    check_cells,
    checked_width,
    common_dtype,
    exact_cast,
    row_offsets,
)
from r3data.segmented import Segmented, check_count, pick_indices
from r3data.tensor_buffer import as_tensor

__all__ = ["PackedRagged"]


class PackedRagged(Segmented):
    """Ragged rows of B samples back to back: ``rows`` (a :class:`PackedTensor` whose segment j
    is row j's values) and ``offsets`` (host int64, B + 1: sample i holds rows
    ``offsets[i]:offsets[i + 1]``)."""

    __slots__ = ("_offsets", "rows")

    def __init__(self, rows: PackedTensor, offsets: Any) -> None:
        if not isinstance(rows, PackedTensor) or rows.values.dim() != 1:
            raise PackedError(
                "PackedRagged rows: expected a PackedTensor of 1-D values, found "
                f"{type(rows).__name__}"
            )
        offsets = row_offsets(offsets, "PackedRagged offsets")
        if offsets[0] != 0 or offsets[-1] != len(rows) or (offsets[1:] < offsets[:-1]).any():
            raise PackedError(
                f"PackedRagged offsets: expected non-decreasing offsets from 0 to the "
                f"{len(rows)} rows, found {offsets[:8].tolist()}"
            )
        offsets.flags.writeable = False
        self.rows = rows
        self._offsets = offsets

    @classmethod
    def from_samples(cls, samples: Sequence[RaggedRows], dtype: Any = None) -> PackedRagged:
        """Concatenate per-sample rows (one copy of the values); ``dtype`` (default: the
        samples' common one, int32 for none) must hold every value exactly."""
        compact = [s.compact() for s in samples]
        if dtype is None:
            dtype = common_dtype([v.dtype for v, _ in compact]) if compact else np.int32
        # each cast on its own: joined first, int64 and uint64 ids would pass through float64
        cast = [exact_cast(v, dtype, "PackedRagged samples") for v, _ in compact]
        values = np.concatenate(cast) if compact else np.empty(0, dtype)
        lengths = np.concatenate([np.diff(o) for _, o in compact]) if compact else np.zeros(0)
        rows = PackedTensor.from_lengths(as_tensor(values), lengths)
        return cls(
            rows, np.concatenate(([0], np.cumsum([s.rows for s in samples], dtype=np.int64)))
        )

    @property
    def values(self) -> torch.Tensor:
        """Every value of every row, back to back."""
        return self.rows.values

    @property
    def row_offsets(self) -> np.ndarray:
        """Host offsets of each row's values (int64, total_rows + 1)."""
        return self.rows.offsets

    @property
    def row_lengths(self) -> np.ndarray:
        return self.rows.lengths

    @property
    def offsets(self) -> np.ndarray:
        """Host offsets of each sample's rows (int64, B + 1)."""
        return self._offsets

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def segment(self, i: int) -> RaggedRows:
        """Sample ``i``'s rows (host values are shared; device values are copied to the host)."""
        i = self._sample(i)
        values = self.values.detach().cpu().numpy()
        return RaggedRows(values, self.row_offsets[self._offsets[i] : self._offsets[i + 1] + 1])

    def _view(self, start: int, stop: int) -> PackedRagged:
        lo, hi = int(self._offsets[start]), int(self._offsets[stop])
        return PackedRagged(self.rows[lo:hi], self._offsets[start : stop + 1] - lo)

    def gather(self, index: Any) -> PackedRagged:
        """Copy the samples picked by an index list or a boolean mask."""
        picks = pick_indices(index, len(self))
        starts = self._offsets[picks]
        counts = self._offsets[picks + 1] - starts
        rows = self.rows.gather(aranges(starts, counts))
        return PackedRagged(rows, np.concatenate(([0], np.cumsum(counts))))

    @staticmethod
    def cat(parts: Sequence[PackedRagged]) -> PackedRagged:
        if not parts:
            raise PackedError("cat needs at least one PackedRagged, found none")
        rows = PackedTensor.cat([p.rows for p in parts])
        lengths = np.concatenate([p.lengths for p in parts])
        return PackedRagged(rows, np.concatenate(([0], np.cumsum(lengths))))

    def repeat(self, n: int) -> PackedRagged:
        check_count(n)
        return self.gather(np.tile(np.arange(len(self)), n))

    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> PackedRagged:
        return PackedRagged(self.rows.to(device, dtype, non_blocking), self._offsets)

    def pin_memory(self) -> PackedRagged:
        return PackedRagged(self.rows.pin_memory(), self._offsets)

    def padded(
        self, width: int | None = None, *, fill: int = MASK_FILL, max_cells: int = DEFAULT_MAX_CELLS
    ) -> PackedTensor:
        """The rows as ``[total_rows, width]`` (default: the widest row), values then ``fill``,
        packed by sample; refused above ``max_cells`` cells."""
        widest = self.rows.max_length()
        width = widest if width is None else checked_width(width, widest)
        check_cells((self.total_rows, width), max_cells)
        padded = self.rows.padded(fill, max_len=width, max_cells=max_cells)
        return PackedTensor(padded, self._offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedRagged):
            return NotImplemented
        return np.array_equal(self._offsets, other._offsets) and self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"PackedRagged(B={len(self)}, rows={self.total_rows}, values={self.values.shape[0]}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def __reduce_ex__(self, protocol: int):
        return (PackedRagged, (self.rows, self._offsets.tolist()))
