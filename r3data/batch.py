"""``TensorBatch``: named fields of one batch of B samples.

Each field is a ``torch.Tensor`` whose first dimension is B, a ``PackedTensor`` with B
segments, a ``PackedRagged`` (ragged rows: sampling masks) with B samples, or a list of B
Python objects (ids). Every operation keeps the fields aligned: selecting samples selects them
in every field and in the metadata that is per sample (:class:`PerSample`).
"""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from r3data.errors import PackedError, PackedIndexError
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.segmented import check_count, pick_indices
from r3data.tensor_buffer import bit_view, rebuild_tensor, tensor_buffer
from r3data.validate import checked_int, slice_bounds

Field = torch.Tensor | PackedTensor | PackedRagged | list
_PACKED = (PackedTensor, PackedRagged)


class PerSample(tuple):
    """A metadata value with one entry per sample: selecting samples selects its entries,
    ``cat`` joins them."""

    __slots__ = ()


def _aggregate(value: Any) -> bool:
    """A value that adds up over parts: statistics (anything with ``+`` that is not a number,
    a string or an array), lists and plain tuples (of names, warnings)."""
    if isinstance(value, tuple):
        return type(value) is tuple  # a PerSample or a namedtuple (a record) is no list of names
    if isinstance(value, list):
        return True
    return hasattr(value, "__add__") and not isinstance(
        value, numbers.Number | str | bytes | np.ndarray | torch.Tensor
    )


def _merge(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, PerSample):
        return PerSample(item for v in values for item in v)
    if isinstance(first, list):
        return [item for v in values for item in v]
    if isinstance(first, tuple):
        return tuple(dict.fromkeys(item for v in values for item in v))
    return functools.reduce(operator.add, values)


def merge_metadata(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The metadata of batches concatenated: :class:`PerSample` values and lists joined, tuples
    joined without repeats (file names), statistics summed, other values kept where every part
    agrees and left out where they differ (the micro-batch index of each part, say)."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if key in part]
        kinds = {type(v) for v in values}
        if (
            len(values) == len(parts)
            and len(kinds) == 1
            and (isinstance(values[0], PerSample) or _aggregate(values[0]))
        ):
            merged[key] = _merge(values)
        elif len(values) == len(parts) and all(_same(v, values[0]) for v in values[1:]):
            merged[key] = values[0]
    return merged


def _same(a: Any, b: Any) -> bool:
    """Whether two metadata values are equal: arrays and tensors by type, shape and value
    (``==`` compares them elementwise)."""
    if isinstance(a, np.ndarray | torch.Tensor) or isinstance(b, np.ndarray | torch.Tensor):
        if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else _field_equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # a value whose == answers no bool
        return a is b


def _picked(metadata: dict[str, Any], picks: np.ndarray | slice) -> dict[str, Any]:
    """``metadata`` of the samples ``picks`` (only :class:`PerSample` values change)."""
    if not any(isinstance(v, PerSample) for v in metadata.values()):
        return metadata
    return {
        k: (
            PerSample(v[picks] if isinstance(picks, slice) else (v[i] for i in picks.tolist()))
            if isinstance(v, PerSample)
            else v
        )
        for k, v in metadata.items()
    }


def _field_size(name: str, value: Field) -> int:
    if isinstance(value, _PACKED):
        return len(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise PackedError(f"field {name!r} must have a batch dimension, found a 0-d tensor")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise PackedError(
        f"field {name!r} must be a torch.Tensor, PackedTensor, PackedRagged or list, found "
        f"{type(value).__name__}"
    )


def _pick(value: Field, picks: np.ndarray) -> Field:
    if isinstance(value, _PACKED):
        return value.gather(picks)
    if isinstance(value, torch.Tensor):
        index = torch.from_numpy(picks).to(value.device, non_blocking=True)
        return bit_view(value).index_select(0, index).view(value.dtype)
    return [value[i] for i in picks]


class TensorBatch(MutableMapping[str, Field]):
    """A mapping of named fields that all hold the same number B of samples, plus metadata.

    Fields may be added or removed (``batch["advantages"] = tensor``) as long as B agrees.
    ``metadata`` describes the batch: a :class:`PerSample` value is selected with the samples,
    ``cat`` merges the parts' metadata (:func:`merge_metadata`) and ``chunk`` splits it.
    """

    def __init__(
        self,
        fields: Mapping[str, Field],
        metadata: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        self._fields = dict(fields)
        self.metadata: dict[str, Any] = dict(metadata or {})
        sizes = {name: _field_size(name, value) for name, value in self._fields.items()}
        if batch_size is None:
            batch_size = next(iter(sizes.values()), 0)
        batch_size = checked_int("batch_size", batch_size, error=PackedError)
        for name, size in sizes.items():
            if size != batch_size:
                raise PackedError(
                    f"field {name!r} must hold B={batch_size} samples, found {size} "
                    f"(sizes: {sizes})"
                )
        for name, value in self.metadata.items():
            if isinstance(value, PerSample) and len(value) != batch_size:
                raise PackedError(
                    f"metadata {name!r} is per sample: it must hold B={batch_size} entries, "
                    f"found {len(value)}"
                )
        self.batch_size = batch_size

    # --- mapping --------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        """A field by name; a sample selection (slice, index list, mask) gives a batch."""
        if isinstance(key, str):
            return self._fields[key]
        if isinstance(key, slice):
            return self.slice(key.start, key.stop, key.step)
        return self.gather(key)

    def __setitem__(self, key: str, value: Field) -> None:
        if not isinstance(key, str):
            raise PackedError(f"field names must be str, found {type(key).__name__}")
        size = _field_size(key, value)
        if size != self.batch_size:
            raise PackedError(f"field {key!r} must hold B={self.batch_size} samples, found {size}")
        self._fields[key] = value

    def __delitem__(self, key: str) -> None:
        del self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def select(self, keys: Sequence[str]) -> TensorBatch:
        """Only the named fields (no copy)."""
        missing = [k for k in keys if k not in self._fields]
        if missing:
            raise PackedError(f"select: fields {missing} not in batch fields {list(self)}")
        return self._with({k: self._fields[k] for k in keys})

    # --- sample selection -----------------------------------------------------------------

    def slice(
        self, start: int | None = None, stop: int | None = None, step: int | None = None
    ) -> TensorBatch:
        """Samples ``start:stop:step``; with step 1 every field is a view."""
        picked = slice(start, stop, step)
        start, stop, step = slice_bounds(picked, self.batch_size, error=PackedIndexError)
        if step != 1:
            return self.gather(np.arange(start, stop, step))
        stop = max(start, stop)
        return self._with(
            {k: v[start:stop] for k, v in self._fields.items()},
            stop - start,
            _picked(self.metadata, slice(start, stop)),
        )

    def gather(self, index: Any) -> TensorBatch:
        """Samples picked by an index list or a boolean mask (a copy)."""
        picks = pick_indices(index, self.batch_size)
        return self._with(
            {k: _pick(v, picks) for k, v in self._fields.items()},
            picks.size,
            _picked(self.metadata, picks),
        )

    def chunk(self, n: int) -> list[TensorBatch]:
        """At most ``n`` consecutive views of ceil(B / n) samples (as ``torch.chunk``).

        :class:`PerSample` metadata is split with the samples; what adds up (statistics,
        lists, tuples) goes with the first part (the others get it empty), so that
        ``cat(batch.chunk(n))`` has the batch's metadata; other values go with every part.
        """
        n = checked_int("chunk count", n, minimum=1, error=PackedError)
        size = -(-self.batch_size // n) if self.batch_size else 0
        if size == 0:
            return [self]
        parts = [self.slice(lo, lo + size) for lo in range(0, self.batch_size, size)]
        empty = {k: type(v)() for k, v in self.metadata.items() if _aggregate(v)}
        for part in parts[1:]:
            part.metadata.update(empty)
        return parts

    @staticmethod
    def cat(batches: Sequence[TensorBatch]) -> TensorBatch:
        """Concatenate batches with the same fields; metadata merged (:func:`merge_metadata`)."""
        if not batches:
            raise PackedError("cat needs at least one TensorBatch, found none")
        keys = list(batches[0])
        for i, b in enumerate(batches):
            if list(b) != keys:
                raise PackedError(f"cat: batch {i} must have fields {keys}, found {list(b)}")
        fields = {k: _cat([b[k] for b in batches], k) for k in keys}
        return TensorBatch(
            fields,
            merge_metadata([b.metadata for b in batches]),
            batch_size=sum(b.batch_size for b in batches),
        )

    def repeat(self, n: int) -> TensorBatch:
        """Tile the batch ``n`` times."""
        check_count(n)
        return self.gather(np.tile(np.arange(self.batch_size), n))

    def repeat_interleave(self, n: int) -> TensorBatch:
        """Each sample ``n`` times in a row."""
        check_count(n)
        return self.gather(np.repeat(np.arange(self.batch_size), n))

    # --- conversion -----------------------------------------------------------------------

    def to(
        self, device: torch.device | str | None = None, non_blocking: bool = False
    ) -> TensorBatch:
        """Move every tensor field; lists stay on the host."""
        return self._map(lambda v: v.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TensorBatch:
        return self._map(lambda v: v.pin_memory())

    def _map(self, fn: Any) -> TensorBatch:
        return self._with({k: v if isinstance(v, list) else fn(v) for k, v in self._fields.items()})

    def _with(
        self,
        fields: dict[str, Field],
        batch_size: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> TensorBatch:
        size = self.batch_size if batch_size is None else batch_size
        return TensorBatch(fields, self.metadata if metadata is None else metadata, batch_size=size)

    # --- comparison, display, pickling ----------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorBatch):
            return NotImplemented
        return (
            self.batch_size == other.batch_size
            and list(self) == list(other)
            and all(_field_equal(self[k], other[k]) for k in self)
            and self.metadata.keys() == other.metadata.keys()
            and all(_same(v, other.metadata[k]) for k, v in self.metadata.items())
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        lines = [f"TensorBatch(B={self.batch_size}"]
        for name, value in self._fields.items():
            lines.append(f"  {name}: {_describe(value)}")
        if self.metadata:
            lines.append(f"  metadata: {sorted(self.metadata)}")
        return "\n".join(lines) + ")"

    def __copy__(self) -> TensorBatch:
        """A new mapping over the same field objects (DataLoader's ``default_convert`` copies)."""
        return self._with(dict(self._fields))

    def __reduce_ex__(self, protocol: int):
        state = {
            k: ("tensor", tensor_buffer(v, protocol)) if isinstance(v, torch.Tensor) else ("raw", v)
            for k, v in self._fields.items()
        }
        return (_rebuild_batch, (state, self.metadata, self.batch_size))


def _rebuild_batch(
    state: dict[str, tuple[str, Any]], metadata: dict, batch_size: int
) -> TensorBatch:
    fields = {k: rebuild_tensor(v) if kind == "tensor" else v for k, (kind, v) in state.items()}
    return TensorBatch(fields, metadata, batch_size=batch_size)


def _cat(values: list[Field], name: str) -> Field:
    kinds = {type(v) for v in values}
    if len(kinds) != 1:
        raise PackedError(
            f"cat: field {name!r} must have one kind, found {sorted(k.__name__ for k in kinds)}"
        )
    first = values[0]
    if isinstance(first, _PACKED):
        return type(first).cat(values)
    if isinstance(first, torch.Tensor):
        for i, v in enumerate(values):
            if (v.dtype, v.shape[1:], v.device) != (first.dtype, first.shape[1:], first.device):
                raise PackedError(
                    f"cat: field {name!r} of batch {i} must have dtype {first.dtype}, trailing "
                    f"shape {tuple(first.shape[1:])} and device {first.device}, found "
                    f"{v.dtype}, {tuple(v.shape[1:])}, {v.device}"
                )
        return torch.cat(values)
    return [item for v in values for item in v]


def _field_equal(a: Field, b: Field) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    return a == b


def _describe(value: Field) -> str:
    if isinstance(value, PackedTensor):
        return f"packed rows={value.total_rows} row_shape={value.row_shape} dtype={value.dtype}"
    if isinstance(value, PackedRagged):
        return f"ragged rows={value.total_rows} values={value.values.shape[0]} dtype={value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"tensor shape={tuple(value.shape)} dtype={value.dtype}"
    return f"list[{len(value)}]"
