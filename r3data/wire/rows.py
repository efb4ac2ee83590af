"""A run of rows of one field with its first token position: what every producer decoder returns.

Two kinds, one interface (``field``, ``pos``, ``rows``, ``end``, ``row_shape``, ``dtype``,
``nbytes``, ``meta``, ``array``, ``clipped``):

- :class:`InlineRows`: rows already in memory, an array ``[rows, *row_shape]`` or, for a
  ragged field, :class:`~r3data.ragged.RaggedRows`;
- :class:`EncodedRows`: rows still base64 on the wire. The loader decodes them once, straight
  into their slice of the batch buffer (:meth:`EncodedRows.decode_into`); ``array`` decodes
  them on first use for everyone else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from r3data.errors import R3DataError, SegmentError, WireFormatError
from r3data.ragged import RaggedRows
from r3data.validate import nonnegative_int
from r3data.wire.blob import Base64Data, decode_base64_into, decoded_length, destination_bytes

__all__ = ["EncodedRows", "InlineRows", "RowSource", "check_route_row_shape", "frozen_meta"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def frozen_meta(meta: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``meta`` as a read-only mapping (shared when it already is one)."""
    if not meta:
        return _EMPTY
    return meta if isinstance(meta, MappingProxyType) else MappingProxyType(dict(meta))


def check_route_row_shape(
    row_shape: tuple[int, ...], what: str, error: type[R3DataError] = WireFormatError
) -> None:
    """The one rule for the row shape of routes, inline or by handle: ``[layers, topk]``, both
    > 0 (a row of ``[]`` would be one byte of the field, ``[layers * topk]`` or ``[layers,
    topk, 1]`` no route row), else ``error`` naming ``what`` and the shape found."""
    if len(row_shape) != 2 or 0 in row_shape:
        raise error(
            f"{what}: expected routes [rows, layers > 0, topk > 0], found rows of {list(row_shape)}"
        )


def _check_pos(owner: str, pos: object) -> int:
    return nonnegative_int(f"{owner}.pos", pos, SegmentError)


def _check_inside(rows: InlineRows | EncodedRows, lo: int, hi: int) -> None:
    """Refuse a clip outside the rows' span (a slice would wrap around or come up short)."""
    if not rows.pos <= lo <= hi <= rows.end:
        raise SegmentError(
            f"field {rows.field!r}: expected positions inside [{rows.pos}, {rows.end}), found "
            f"[{lo}, {hi})"
        )


@dataclass(frozen=True, eq=False, slots=True)
class InlineRows:
    """Rows ``array[i]`` of ``field`` for token positions ``pos + i``.

    ``array`` is ``[rows, *row_shape]`` (routes: ``[rows, layers, topk]``), or
    :class:`~r3data.ragged.RaggedRows` for a ragged field; ``meta`` carries what the producer
    said about the rows (choice index, prompt and completion lengths, ...), read-only.
    """

    field: str
    array: np.ndarray | RaggedRows
    pos: int
    meta: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise SegmentError(f"InlineRows.field: expected a non-empty str, found {self.field!r}")
        if not isinstance(self.array, RaggedRows) and (
            not isinstance(self.array, np.ndarray) or self.array.ndim < 1
        ):
            found = getattr(self.array, "shape", type(self.array).__name__)
            raise SegmentError(
                f"InlineRows({self.field!r}).array: expected a numpy array with at least one "
                f"dimension (rows first) or RaggedRows, found {found}"
            )
        object.__setattr__(self, "pos", _check_pos(f"InlineRows({self.field!r})", self.pos))
        object.__setattr__(self, "meta", frozen_meta(self.meta))

    @property
    def ragged(self) -> bool:
        return isinstance(self.array, RaggedRows)

    @property
    def rows(self) -> int:
        """Number of rows (token positions) covered."""
        return self.array.rows if self.ragged else int(self.array.shape[0])

    @property
    def end(self) -> int:
        """One past the last position covered."""
        return self.pos + self.rows

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (routes: ``(layers, topk)``; ragged rows: ``()``)."""
        return () if self.ragged else tuple(self.array.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def clipped(self, lo: int, hi: int) -> InlineRows:
        """The rows at positions ``[lo, hi)`` (inside the span): a view."""
        if (lo, hi) == (self.pos, self.end):
            return self
        _check_inside(self, lo, hi)
        return InlineRows(self.field, self.array[lo - self.pos : hi - self.pos], lo, self.meta)


class EncodedRows:
    """Rows of ``field`` for positions ``pos + i`` that are still base64 on the wire.

    ``data`` holds the base64 characters (a view of the raw body, or a parsed ``str``); the
    rows start ``skip`` decoded bytes in (a vLLM ``.npy`` header, rows clipped away) and are
    ``rows x row_shape`` of ``dtype``, little-endian. The claim is checked against the
    blob's length on construction; the characters are checked as they are decoded.
    """

    __slots__ = (
        "_array",
        "data",
        "dtype",
        "end",
        "field",
        "meta",
        "nbytes",
        "pos",
        "row_bytes",
        "row_shape",
        "rows",
        "skip",
        "what",
    )
    # ``end``, ``row_bytes`` and ``nbytes`` are derived once, here and in :meth:`clipped`.

    def __init__(
        self,
        field: str,
        data: Base64Data,
        *,
        dtype: np.dtype,
        row_shape: tuple[int, ...],
        rows: int,
        pos: int,
        skip: int = 0,
        meta: Mapping[str, Any] | None = None,
        what: str = "",
    ) -> None:
        self.field = field
        self.data = data
        self.dtype = dtype = np.dtype(dtype)
        self.row_shape = row_shape = tuple(row_shape)
        self.rows = rows
        if type(pos) is not int or pos < 0:
            pos = _check_pos(f"EncodedRows({field!r})", pos)
        self.pos = pos
        self.end = pos + rows
        self.skip = skip
        self.meta = frozen_meta(meta)
        self.what = what or f"field {field!r}"
        self._array: np.ndarray | None = None
        self.row_bytes = row_bytes = dtype.itemsize * math.prod(row_shape)
        self.nbytes = rows * row_bytes
        available = decoded_length(data, self.what)
        if skip + self.nbytes > available:
            raise WireFormatError(
                f"{self.what}: expected {self.nbytes} bytes of rows after byte {skip}, found "
                f"base64 of {len(data)} characters that decodes to {available} bytes"
            )

    @property
    def ragged(self) -> bool:
        return False

    @property
    def array(self) -> np.ndarray:
        """The rows decoded (once, on first use)."""
        if self._array is None:
            array = np.empty((self.rows, *self.row_shape), self.dtype)
            self.decode_into(array)
            self._array = array
        return self._array

    def decode_into(self, dest: np.ndarray, on_bytes: Callable[[int], None] | None = None) -> None:
        """Decode the rows into ``dest``, a writable C-contiguous buffer of :attr:`nbytes`;
        ``on_bytes(done)`` follows the bytes in place, chunk by chunk."""
        if self._array is not None:
            np.copyto(destination_bytes(dest, self.what), self._array.reshape(-1).view(np.uint8))
            if on_bytes is not None:
                on_bytes(self.nbytes)
            return
        decode_base64_into(self.data, dest, skip=self.skip, what=self.what, on_bytes=on_bytes)

    def clipped(self, lo: int, hi: int) -> EncodedRows:
        """The rows at positions ``[lo, hi)`` (inside the span), still encoded."""
        if (lo, hi) == (self.pos, self.end):
            return self
        _check_inside(self, lo, hi)
        part = object.__new__(EncodedRows)
        part.field, part.data, part.dtype = self.field, self.data, self.dtype
        part.row_shape, part.meta, part.what = self.row_shape, self.meta, self.what
        part.pos, part.rows, part.end = lo, hi - lo, hi
        part.row_bytes, part.nbytes = self.row_bytes, (hi - lo) * self.row_bytes
        part.skip = self.skip + (lo - self.pos) * self.row_bytes
        part._array = None if self._array is None else self._array[lo - self.pos : hi - self.pos]
        return part

    def __repr__(self) -> str:
        return (
            f"EncodedRows({self.field!r}, pos={self.pos}, rows={self.rows}, "
            f"row_shape={self.row_shape}, dtype={self.dtype})"
        )


RowSource = InlineRows | EncodedRows
"""Rows from the wire, with their positions."""
