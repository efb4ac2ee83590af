"""``RankRows``: packed rows of one rank's share of each sample, knowing how they were cut.

A rank-local read (``r3data.loader(..., layout=...)``) holds, for each sample, only the rows
of ``layout.local_ranges(full lengths)`` back to back. Such rows look like a batch of shorter
samples: laid out with any other layout, or as if they were whole, they would route every
token wrongly without an error. ``RankRows`` carries the layout it was cut by and the full
sample lengths, so that :func:`~r3data.layout.expand` and its siblings read them and refuse
a mix-up; every batch operation (slices, gathers, ``cat``, ``.to``) keeps them.

Under most layouts a sample's share depends on the whole micro-batch (sequence parallelism
slices the batch's concatenated stream; BSHD pads to its longest sample), so rows selected
from the batch they were read for (a slice, a gather, a ``cat`` of several) are no longer any
batch's rank-local read: they remember it (``selected``) and expanding them raises, unless
the layout cuts each sample on its own (THD without sequence parallelism, BSHD with a fixed
``seq_length``, or no split at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from r3data.errors import LayoutError
from r3data.layout.token_layout import TokenLayout, as_lengths
from r3data.packed import PackedTensor
from r3data.segmented import pick_indices
from r3data.tensor_buffer import rebuild_tensor, tensor_buffer

__all__ = ["RankRows"]


class RankRows(PackedTensor):
    """A :class:`PackedTensor` of rank-local rows, with ``layout`` and ``full_lengths``."""

    __slots__ = ("full_lengths", "layout", "selected")

    def __init__(
        self, values: torch.Tensor, cu_seqlens: Any, *, layout: TokenLayout, full_lengths: Any
    ) -> None:
        super().__init__(values, cu_seqlens)
        if not isinstance(layout, TokenLayout):
            raise LayoutError(f"layout must be a TokenLayout, found {type(layout).__name__}")
        full = as_lengths(full_lengths)
        expected = layout.local_lengths(full)
        if full.size != len(self) or not np.array_equal(expected, self.lengths):
            raise LayoutError(
                f"RankRows: {len(self)} samples of {self.lengths.tolist()[:8]} rows are not "
                f"this layout's share of samples of full lengths {full.tolist()[:8]} "
                f"(expected {expected.tolist()[:8]} rows)"
            )
        self._set(layout, full, selected=False)

    @classmethod
    def of(
        cls,
        rows: PackedTensor,
        layout: TokenLayout,
        full_lengths: np.ndarray,
        *,
        selected: bool = False,
    ) -> RankRows:
        """Wrap ``rows`` (already cut by ``layout``: the loader's fill) without a check."""
        wrapped = object.__new__(cls)
        wrapped.values = rows.values
        wrapped._offsets = rows.offsets
        wrapped._device_cu_seqlens = None
        wrapped._set(layout, np.asarray(full_lengths, np.int64), selected)
        return wrapped

    def _set(self, layout: TokenLayout, full: np.ndarray, selected: bool) -> None:
        full = full.copy()
        full.flags.writeable = False
        self.layout = layout
        self.full_lengths = full
        self.selected = selected and not self.per_sample

    @property
    def is_whole(self) -> bool:
        """True when the layout keeps every row (no CP or SP split): the rows are full samples."""
        return self.layout.cp_size == 1 and self.layout.sp_size == 1

    @property
    def per_sample(self) -> bool:
        """True when the layout cuts each sample on its own (:attr:`TokenLayout.per_sample`)."""
        return self.layout.per_sample

    # --- every operation keeps layout and full lengths -------------------------------------

    def _like(self, rows: PackedTensor, full: np.ndarray, *, selected: bool = True) -> RankRows:
        return RankRows.of(rows, self.layout, full, selected=selected or self.selected)

    def __getitem__(self, index: Any) -> torch.Tensor | RankRows:
        got = super().__getitem__(index)
        if not isinstance(got, PackedTensor) or isinstance(got, RankRows):
            return got  # one sample's rows, or a gather (already RankRows)
        start, stop, _ = index.indices(len(self))  # a contiguous slice
        stop = max(start, stop)
        return self._like(got, self.full_lengths[start:stop], selected=stop - start < len(self))

    def gather(self, index: Any) -> RankRows:
        return self._like(super().gather(index), self.full_lengths[pick_indices(index, len(self))])

    @staticmethod
    def cat(parts: Sequence[PackedTensor]) -> RankRows:
        """Concatenate rank-local batches cut by one layout (a selection: see the module)."""
        if not parts or not isinstance(parts[0], RankRows):
            raise LayoutError("cat: expected RankRows parts, found none")
        layout = parts[0].layout
        for i, p in enumerate(parts):
            if not isinstance(p, RankRows) or p.layout != layout:
                found = p.layout if isinstance(p, RankRows) else type(p).__name__
                raise LayoutError(f"cat: part {i} must be RankRows cut by {layout}, found {found}")
        full = np.concatenate([p.full_lengths for p in parts])
        selected = len(parts) > 1 or parts[0].selected
        return RankRows.of(PackedTensor.cat(parts), layout, full, selected=selected)

    def repeat(self, n: int) -> RankRows:
        return self._like(super().repeat(n), np.tile(self.full_lengths, n))

    def _with_values(self, values: torch.Tensor) -> RankRows:
        return self._like(super()._with_values(values), self.full_lengths, selected=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankRows):
            return NotImplemented
        return (
            self.layout == other.layout
            and self.selected == other.selected
            and np.array_equal(self.full_lengths, other.full_lengths)
            and super().__eq__(other)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RankRows(B={len(self)}, rows={self.total_rows} of {int(self.full_lengths.sum())}, "
            f"row_shape={self.row_shape}, dtype={self.dtype}, layout={self.layout})"
        )

    def __reduce_ex__(self, protocol: int):
        return (
            _rebuild_rank_rows,
            (
                tensor_buffer(self.values, protocol),
                self.offsets.tolist(),
                self.layout,
                self.full_lengths.tolist(),
                self.selected,
            ),
        )


def _rebuild_rank_rows(
    values: Any, offsets: list[int], layout: TokenLayout, full: list[int], selected: bool
) -> RankRows:
    rows = PackedTensor(rebuild_tensor(values), offsets)
    return RankRows.of(rows, layout, np.array(full, np.int64), selected=selected)
