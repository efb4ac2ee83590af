"""Rows of varying width (sampling masks, sampled support) as CSR: values plus row offsets.

One form from the wire and the payload file to the batch, so ragged rows are copied once:
:class:`RaggedRows` is one run of rows on the host, row ``i`` being
``values[offsets[i]:offsets[i + 1]]`` (a slice of rows is a view: its offsets need not start
at 0); a batch holds them as :class:`~r3data.packed_ragged.PackedRagged`. A padded
``[rows, widest]`` view is made only on request, and bounded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3data.errors import PackedError, PackedIndexError
from r3data.validate import checked_fill, checked_int, slice_bounds

__all__ = [
    "DEFAULT_MAX_CELLS",
    "MASK_FILL",
    "MAX_TOKEN_ID",
    "RaggedRows",
    "check_cells",
    "checked_width",
    "common_dtype",
    "exact_cast",
    "first_bad_id",
    "row_offsets",
]

MASK_FILL = -1
"""What a padded view puts after each row's values."""

DEFAULT_MAX_CELLS = 1 << 28
"""Largest padded view made unless the caller raises it (1 GiB of int32)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest id an integer ragged row may hold: token ids are int32 on every wire, never
negative (-1 is padding, not an id)."""


def first_bad_id(values: np.ndarray) -> int | None:
    """The flat index of the first value of integer ``values`` outside [0,
    :data:`MAX_TOKEN_ID`] (None: every value is within, or ``values`` holds no integers).
    Costs two reductions unless one is found; a dtype that cannot leave the range costs none."""
    kind = values.dtype.kind
    if values.size == 0 or kind not in "iu":
        return None
    if kind == "u" and np.iinfo(values.dtype).max <= MAX_TOKEN_ID:
        return None
    if (kind == "u" or int(values.min()) >= 0) and int(values.max()) <= MAX_TOKEN_ID:
        return None
    flat = values.reshape(-1)
    return int(np.argmax((flat < 0) | (flat > MAX_TOKEN_ID)))


def row_offsets(offsets: Any, what: str) -> np.ndarray:
    array = np.asarray(offsets)
    if array.ndim != 1 or array.size == 0 or (array.dtype.kind not in "iu"):
        raise PackedError(
            f"{what}: expected 1-D integer row offsets (rows + 1 of them), found shape "
            f"{array.shape} of {array.dtype}"
        )
    return array.astype(np.int64, copy=False)


def common_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The dtype that holds values of every one of ``dtypes``: numpy's, except that integers
    stay integers (numpy's int64 with uint64 is float64, which rounds ids above 2**53)."""
    common = np.result_type(*dtypes)
    if common.kind == "f" and all(np.dtype(d).kind in "biu" for d in dtypes):
        return np.dtype(np.int64)  # exact_cast refuses what it cannot hold
    return common


def exact_cast(values: np.ndarray, dtype: Any, what: str) -> np.ndarray:
    """``values`` as ``dtype``, refused where a value would change (wrap around, truncate)."""
    target = np.dtype(dtype)
    if values.dtype == target:
        return values
    if values.dtype.kind not in "biuf":
        raise PackedError(f"{what}: expected numbers, found dtype {values.dtype}")
    cast = values.astype(target)
    if not np.can_cast(values.dtype, target):
        changed = np.flatnonzero(~(cast == values))
        if changed.size:
            raise PackedError(
                f"{what}: values do not fit {target} exactly: found {values[changed[0]].item()!r}"
            )
    return cast


class RaggedRows:
    """CSR rows on the host: ``values`` (1-D numpy) and ``offsets`` (int64, rows + 1)."""

    __slots__ = ("offsets", "values")

    def __init__(self, values: np.ndarray, offsets: Any, *, what: str = "ragged rows") -> None:
        values = np.asarray(values)
        if values.ndim != 1:
            raise PackedError(f"{what}: expected 1-D values, found shape {values.shape}")
        offsets = row_offsets(offsets, what)
        falls = offsets[1:] < offsets[:-1]  # compared: a difference wraps around int64
        if offsets[0] < 0 or offsets[-1] > values.size or falls.any():
            raise PackedError(
                f"{what}: expected non-decreasing offsets within [0, {values.size}], found "
                f"{offsets[:8].tolist()}{'...' if offsets.size > 8 else ''}"
            )
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: Any, *, what: str = "ragged rows"):
        """Rows of ``lengths`` values each, back to back."""
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
            raise PackedError(f"{what}: expected 1-D integer row lengths, found {lengths.dtype}")
        if lengths.size and int(lengths.min()) < 0:
            raise PackedError(f"{what}: expected row lengths >= 0, found {int(lengths.min())}")
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != np.asarray(values).size:
            raise PackedError(
                f"{what}: expected row lengths summing to the {np.asarray(values).size} values, "
                f"found {int(offsets[-1])}"
            )
        return cls(values, offsets, what=what)

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: Any = np.int32) -> RaggedRows:
        """One row per 1-D array in ``rows``."""
        arrays = [np.asarray(row).reshape(-1) for row in rows]
        # each cast on its own: joined first, int64 and uint64 rows would pass through float64
        filled = [exact_cast(a, dtype, "ragged rows") for a in arrays if a.size]
        values = np.concatenate(filled) if filled else np.empty(0, dtype)
        return cls.from_lengths(values, [a.size for a in arrays])

    @classmethod
    def from_padded(cls, padded: Any, *, fill: int = MASK_FILL, what: str = "padded rows"):
        """``[rows, width]`` rows, each its values first and ``fill`` after them. A dtype that
        cannot hold ``fill`` (-1 in an unsigned one) holds no padding: every value is kept, and
        the value ``fill`` wraps to there (-1 in uint16: 65535) is refused, padding or id?"""
        array = np.asarray(padded)
        if array.ndim != 2 or (array.size and array.dtype.kind not in "iu"):
            raise PackedError(
                f"{what}: expected a [rows, width] integer array, found shape {array.shape} of "
                f"{array.dtype}"
            )
        if array.size:
            _check_no_wrapped_fill(array, fill, what)
        kept = array != fill
        lengths = kept.sum(axis=1, dtype=np.int64)
        holes = kept != (np.arange(array.shape[1]) < lengths[:, None])
        if holes.any():
            row = int(holes.any(axis=1).argmax())
            raise PackedError(
                f"{what}: row {row} has {fill} before a kept id; padding must come last"
            )
        return cls.from_lengths(array[kept], lengths, what=what)

    @property
    def rows(self) -> int:
        return self.offsets.size - 1

    def __len__(self) -> int:
        return self.rows

    @property
    def lengths(self) -> np.ndarray:
        """Values per row (int64)."""
        return np.diff(self.offsets)

    @property
    def widest(self) -> int:
        return int(self.lengths.max()) if self.rows else 0

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the values the rows hold."""
        return int(self.offsets[-1] - self.offsets[0]) * self.values.itemsize

    def __getitem__(self, rows: slice) -> RaggedRows:
        """Rows ``rows`` (a step-1 slice), sharing memory."""
        if not isinstance(rows, slice):
            raise PackedError(f"ragged rows take step-1 slices, found {type(rows).__name__}")
        start, stop, step = slice_bounds(rows, self.rows, error=PackedIndexError)
        if step != 1:
            raise PackedError(f"ragged rows take step-1 slices, found step {step}")
        view = object.__new__(RaggedRows)
        view.values = self.values
        view.offsets = self.offsets[start : max(start, stop) + 1]
        return view

    def compact(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values, offsets)`` of exactly these rows, offsets from 0 (views, no copy)."""
        first = int(self.offsets[0])
        return self.values[first : int(self.offsets[-1])], self.offsets - first

    def padded(
        self, width: int | None = None, *, fill: int = MASK_FILL, max_cells: int = DEFAULT_MAX_CELLS
    ) -> np.ndarray:
        """``[rows, width]`` (default: the widest row), each row's values then ``fill``."""
        width = self.widest if width is None else checked_width(width, self.widest)
        check_cells((self.rows, width), max_cells)
        checked_fill("fill", fill, self.dtype, error=PackedError)
        values, offsets = self.compact()
        out = np.full((self.rows, width), fill, dtype=values.dtype)
        out[np.arange(width) < np.diff(offsets)[:, None]] = values
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RaggedRows):
            return NotImplemented
        mine, theirs = self.compact(), other.compact()
        return np.array_equal(mine[1], theirs[1]) and np.array_equal(mine[0], theirs[0])

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RaggedRows(rows={self.rows}, values={int(self.offsets[-1] - self.offsets[0])}, dtype={self.dtype})"


def _check_no_wrapped_fill(array: np.ndarray, fill: int, what: str) -> None:
    """Refuse, when ``array``'s dtype cannot hold ``fill``, any value ``fill`` wraps to in it:
    -1 padding cast to an unsigned dtype would otherwise be read as ids."""
    info = np.iinfo(array.dtype)
    if info.min <= fill <= info.max:
        return
    wrapped = (int(fill) - info.min) % (1 << info.bits) + info.min
    found = np.flatnonzero(array == wrapped)
    if found.size:
        row, column = divmod(int(found[0]), array.shape[1])
        raise PackedError(
            f"{what}: expected rows padded with {fill}, which {array.dtype} cannot hold; found "
            f"{wrapped} ({fill} wrapped?) at row {row}, column {column}; pass fill={wrapped} if "
            f"it is padding"
        )


def checked_width(width: Any, widest: int) -> int:
    """A padded view's width: an int, at least the widest row."""
    width = checked_int("padded width", width, error=PackedError)
    if width < widest:
        raise PackedError(f"padded width must be >= the widest row {widest}, found {width}")
    return width


def check_cells(shape: Sequence[int], max_cells: int, *, kept: str = "ragged") -> None:
    """Refuse a padded view of ``shape`` above ``max_cells`` values, before it is allocated
    (rows of a hostile length would otherwise make it huge); ``kept`` names the rows' form."""
    cells = math.prod(shape)
    if cells > max_cells:
        raise PackedError(
            f"a padded view {list(shape)} has {cells} cells, more than max_cells {max_cells}; "
            f"keep the rows {kept} or pass a larger max_cells"
        )
