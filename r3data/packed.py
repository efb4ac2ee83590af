"""``PackedTensor``: ragged token-aligned rows stored back to back.

A batch of B sequences of different lengths is one ``values`` tensor ``[total_rows, *row_shape]``
plus ``cu_seqlens`` (B+1 offsets). The offsets are also kept on the host, so looking up,
slicing or measuring a segment never reads a device tensor (no GPU synchronisation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from r3data.errors import PackedError
from r3data.ragged import DEFAULT_MAX_CELLS, check_cells
from r3data.segmented import Segmented, check_count, pick_indices
from r3data.tensor_buffer import as_tensor, bit_view, rebuild_tensor, tensor_buffer
from r3data.validate import INT64_MAX, checked_fill, checked_int

Side = Literal["left", "right"]


def _host_offsets(values: Any, name: str = "cu_seqlens") -> np.ndarray:
    """Host int64 copy of offsets (or lengths: ``name``) given as a tensor, array or sequence
    (reads a device tensor once)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise PackedError(f"{name} must hold integers, found dtype {values.dtype}")
        values = values.detach().cpu().numpy()
    found = np.asarray(values)
    if found.dtype.kind not in "iu" and not (found.size == 0 and found.dtype.kind == "f"):
        raise PackedError(f"{name} must hold integers, found dtype {found.dtype}")
    if found.ndim != 1:
        raise PackedError(f"{name} must be 1-D, found shape {tuple(found.shape)}")
    if found.dtype.kind == "u" and found.size and int(found.max()) > INT64_MAX:  # would wrap
        raise PackedError(f"{name} must be at most 2**63 - 1, found {int(found.max())}")
    return found.astype(np.int64)


def _validate_offsets(offsets: np.ndarray, total_rows: int) -> None:
    if offsets.size == 0:
        raise PackedError("cu_seqlens must hold B+1 >= 1 offsets, found an empty array")
    if offsets[0] != 0:
        raise PackedError(f"cu_seqlens must start at 0, found {int(offsets[0])}")
    if offsets[-1] != total_rows:
        raise PackedError(
            f"cu_seqlens must end at the number of rows {total_rows}, found {int(offsets[-1])}"
        )
    falls = offsets[1:] < offsets[:-1]  # compared: a difference wraps around int64
    if falls.any():
        at = int(np.argmax(falls))
        raise PackedError(
            f"cu_seqlens must be non-decreasing, found {int(offsets[at])} then "
            f"{int(offsets[at + 1])} at index {at}"
        )
    if total_rows > np.iinfo(np.int32).max:
        raise PackedError(f"cu_seqlens is int32: at most 2**31-1 rows, found {total_rows}")


def _offsets_from_lengths(lengths: Any) -> np.ndarray:
    lengths = _host_offsets(lengths, "lengths")
    if lengths.size and lengths.min() < 0:
        raise PackedError(f"lengths must be >= 0, found {int(lengths.min())}")
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    if (offsets[1:] < offsets[:-1]).any():  # lengths >= 0: only a sum past int64 falls
        raise PackedError(
            f"lengths must sum to at most 2**63 - 1 rows, found {sum(map(int, lengths))}"
        )
    return offsets


def aranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, counts)])`` in one vectorised pass.

    ``counts`` must be >= 0; the result is int64.
    """
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    firsts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - firsts, counts)


def _rows_of(offsets: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Row indices of segments ``picks`` in order."""
    starts = offsets[picks]
    return aranges(starts, offsets[picks + 1] - starts)


class PackedTensor(Segmented):
    """Rows of B sequences back to back: ``values[cu_seqlens[i]:cu_seqlens[i+1]]`` is sequence i."""

    __slots__ = ("_device_cu_seqlens", "_offsets", "values")

    def __init__(self, values: torch.Tensor, cu_seqlens: Any) -> None:
        if not isinstance(values, torch.Tensor):
            raise PackedError(f"values must be a torch.Tensor, found {type(values).__name__}")
        if values.dim() < 1:
            raise PackedError("values must have a row dimension, found a 0-d tensor")
        offsets = _host_offsets(cu_seqlens)
        _validate_offsets(offsets, values.shape[0])
        offsets.flags.writeable = False
        self.values = values
        self._offsets = offsets
        # a private copy: the caller's tensor may change, the host offsets will not
        self._device_cu_seqlens = (
            cu_seqlens.clone() if _is_device_int32(cu_seqlens, values) else None
        )

    # --- constructors ---------------------------------------------------------------------

    @classmethod
    def from_lengths(cls, values: torch.Tensor | np.ndarray, lengths: Any) -> PackedTensor:
        """Wrap ``values`` whose rows are sequences of ``lengths`` back to back."""
        return cls(as_tensor(values), _offsets_from_lengths(lengths))

    @classmethod
    def from_segments(
        cls,
        segments: Iterable[torch.Tensor | np.ndarray],
        *,
        row_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> PackedTensor:
        """Concatenate per-sequence tensors or numpy arrays (one copy)."""
        tensors = [as_tensor(s) for s in segments]
        if not tensors:
            if row_shape is None or dtype is None:
                raise PackedError("from_segments([]) needs row_shape and dtype")
            return cls.empty(row_shape, dtype)
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.dim() < 1 or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise PackedError(
                    f"segment {i} must have row shape {tuple(first.shape[1:])} and dtype "
                    f"{first.dtype}, found shape {tuple(t.shape)} and dtype {t.dtype}"
                )
        values = torch.cat(tensors) if len(tensors) > 1 else first
        return cls(values, _offsets_from_lengths([t.shape[0] for t in tensors]))

    @classmethod
    def empty(
        cls, row_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> PackedTensor:
        """A batch of zero sequences."""
        return cls(torch.empty((0, *row_shape), dtype=dtype, device=device), [0])

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: Any, side: Side = "right") -> PackedTensor:
        """Inverse of :meth:`padded`: keep the first (right) or last (left) ``lengths[b]`` rows."""
        padded = as_tensor(padded)
        offsets = _offsets_from_lengths(lengths)
        batch = offsets.size - 1
        if padded.dim() < 2 or padded.shape[0] != batch:
            raise PackedError(
                f"padded must be [B={batch}, max_len, ...], found shape {tuple(padded.shape)}"
            )
        max_len = padded.shape[1]
        if batch and int(np.diff(offsets).max()) > max_len:
            raise PackedError(
                f"lengths must be <= max_len {max_len}, found {int(np.diff(offsets).max())}"
            )
        rows = _padded_rows(offsets, max_len, side)
        flat = padded.reshape(batch * max_len, *padded.shape[2:])
        picked = bit_view(flat).index_select(0, _index(rows, flat.device))
        return cls(picked.view(padded.dtype), offsets)

    # --- shape ----------------------------------------------------------------------------

    @property
    def offsets(self) -> np.ndarray:
        """Host offsets (int64, read-only, B+1); reading them never touches a device."""
        return self._offsets

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Offsets as an int32 tensor on the values' device (created on first use)."""
        if self._device_cu_seqlens is None:
            host = torch.from_numpy(self._offsets.astype(np.int32))
            self._device_cu_seqlens = host.to(self.values.device, non_blocking=True)
        return self._device_cu_seqlens

    sequence_lengths = Segmented.lengths

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def max_length(self) -> int:
        return int(self.lengths.max()) if len(self) else 0

    # --- indexing -------------------------------------------------------------------------

    def segment(self, i: int) -> torch.Tensor:
        """Rows of sequence ``i`` (a view)."""
        i = self._sample(i)
        return self.values[self._offsets[i] : self._offsets[i + 1]]

    def _view(self, start: int, stop: int) -> PackedTensor:
        lo, hi = self._offsets[start], self._offsets[stop]
        return PackedTensor(self.values[lo:hi], self._offsets[start : stop + 1] - lo)

    def gather(
        self, index: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor
    ) -> PackedTensor:
        """Copy the segments picked by an index list or a boolean mask into a new buffer."""
        picks = pick_indices(index, len(self))
        rows = _rows_of(self._offsets, picks)
        values = bit_view(self.values).index_select(0, _index(rows, self.device))
        lengths = self._offsets[picks + 1] - self._offsets[picks]
        return PackedTensor(values.view(self.dtype), _offsets_from_lengths(lengths))

    def __iter__(self):
        return (self.segment(i) for i in range(len(self)))

    # --- batch algebra --------------------------------------------------------------------

    @staticmethod
    def cat(parts: Sequence[PackedTensor]) -> PackedTensor:
        """Concatenate batches (all must share row shape, dtype and device)."""
        if not parts:
            raise PackedError("cat needs at least one PackedTensor, found none")
        first = parts[0]
        for i, p in enumerate(parts):
            if (p.row_shape, p.dtype, p.device) != (first.row_shape, first.dtype, first.device):
                raise PackedError(
                    f"cat: part {i} must have row shape {first.row_shape}, dtype {first.dtype} "
                    f"and device {first.device}, found {p.row_shape}, {p.dtype}, {p.device}"
                )
        values = torch.cat([p.values for p in parts])
        return PackedTensor(
            values, _offsets_from_lengths(np.concatenate([p.lengths for p in parts]))
        )

    def repeat(self, n: int) -> PackedTensor:
        """Tile the whole batch ``n`` times: B*n sequences."""
        check_count(n)
        values = self.values.repeat(n, *([1] * len(self.row_shape)))
        return PackedTensor(values, _offsets_from_lengths(np.tile(self.lengths, n)))

    # --- conversion -----------------------------------------------------------------------

    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> PackedTensor:
        """Move or cast ``values`` (a dtype alone may come first, as in ``Tensor.to``); the
        host offsets travel without a copy."""
        device, dtype = device_and_dtype(device, dtype)
        values = self.values.to(device=device, dtype=dtype, non_blocking=non_blocking)
        return self._with_values(values)

    def pin_memory(self) -> PackedTensor:
        """Page-lock ``values`` for asynchronous host-to-device copies."""
        return self._with_values(self.values.pin_memory())

    def contiguous(self) -> PackedTensor:
        return self._with_values(self.values.contiguous())

    def numpy(self) -> list[np.ndarray]:
        """Per-sequence numpy views of CPU values (``from_segments`` inverts it)."""
        array = self.values.numpy()
        return [array[lo:hi] for lo, hi in zip(self._offsets[:-1], self._offsets[1:], strict=True)]

    def padded(
        self,
        fill: float | int = 0,
        side: Side = "right",
        max_len: int | None = None,
        *,
        max_cells: int = DEFAULT_MAX_CELLS,
    ) -> torch.Tensor:
        """A ``[B, max_len, *row_shape]`` rectangle (for code that still wants one); refused
        above ``max_cells`` values (one long sequence makes every sequence that long)."""
        longest = self.max_length()
        max_len = longest if max_len is None else checked_int("max_len", max_len, error=PackedError)
        if max_len < longest:
            raise PackedError(f"max_len must be >= the longest sequence {longest}, found {max_len}")
        checked_fill("fill", fill, self.dtype, error=PackedError)
        rows = _padded_rows(self._offsets, max_len, side)  # checks side before allocating
        batch = len(self)
        check_cells((batch, max_len, *self.row_shape), max_cells, kept="packed")
        out = torch.full(
            (batch * max_len, *self.row_shape), fill, dtype=self.dtype, device=self.device
        )
        bit_view(out).index_copy_(0, _index(rows, self.device), bit_view(self.values))
        return out.view(batch, max_len, *self.row_shape)

    def _with_values(self, values: torch.Tensor) -> PackedTensor:
        """Same offsets (already validated, shared read-only), new values of the same rows."""
        packed = object.__new__(PackedTensor)
        packed.values = values
        packed._offsets = self._offsets
        packed._device_cu_seqlens = None
        return packed

    # --- comparison and display -----------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedTensor):
            return NotImplemented
        return (
            np.array_equal(self._offsets, other._offsets)
            and self.values.shape == other.values.shape
            and self.dtype == other.dtype
            and torch.equal(self.values, other.values.to(self.device))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"PackedTensor(B={len(self)}, rows={self.total_rows}, row_shape={self.row_shape}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    # --- pickling -------------------------------------------------------------------------

    def __reduce_ex__(self, protocol: int):
        return (_rebuild_packed, (tensor_buffer(self.values, protocol), self._offsets.tolist()))


def _rebuild_packed(values: Any, offsets: list[int]) -> PackedTensor:
    return PackedTensor(rebuild_tensor(values), offsets)


def device_and_dtype(
    device: torch.device | str | torch.dtype | None, dtype: torch.dtype | None
) -> tuple[torch.device | str | None, torch.dtype | None]:
    """``to``'s arguments: ``to(torch.int32)`` casts, as ``Tensor.to`` does."""
    if isinstance(device, torch.dtype):
        if dtype is not None:
            raise PackedError(f"to: dtype given twice, found {device} and {dtype}")
        return None, device
    return device, dtype


def _is_device_int32(cu_seqlens: Any, values: torch.Tensor) -> bool:
    return (
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dtype == torch.int32
        and cu_seqlens.device == values.device
    )


def _padded_rows(offsets: np.ndarray, max_len: int, side: Side) -> np.ndarray:
    """Flat ``b * max_len + t`` destination of every packed row in a padded rectangle."""
    if side not in ("left", "right"):
        raise PackedError(f"side must be 'left' or 'right', found {side!r}")
    lengths = np.diff(offsets)
    batch = lengths.size
    seq_of_row = np.repeat(np.arange(batch, dtype=np.int64), lengths)
    within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    if side == "left":
        within += np.repeat(max_len - lengths, lengths)
    return seq_of_row * max_len + within


def _index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(rows).to(device, non_blocking=True)
