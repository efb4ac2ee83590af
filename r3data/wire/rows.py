"""A run of rows of one field, inline: what every producer decoder returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from r3data.errors import SegmentError

__all__ = ["InlineRows"]


@dataclass(frozen=True, eq=False)
class InlineRows:
    """Rows ``array[i]`` of ``field`` for token positions ``pos + i``.

    ``array`` is ``[rows, *row_shape]`` (routes: ``[rows, layers, topk]``); ``meta`` carries
    what the producer said about the rows (choice index, prompt and completion lengths, dense
    layers, ...), read-only.
    """

    field: str
    array: np.ndarray
    pos: int
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise SegmentError(f"InlineRows.field: expected a non-empty str, found {self.field!r}")
        if not isinstance(self.array, np.ndarray) or self.array.ndim < 1:
            found = getattr(self.array, "shape", type(self.array).__name__)
            raise SegmentError(
                f"InlineRows({self.field!r}).array: expected a numpy array with at least one "
                f"dimension (rows first), found {found}"
            )
        if isinstance(self.pos, bool) or not isinstance(self.pos, int | np.integer):
            raise SegmentError(
                f"InlineRows({self.field!r}).pos: expected an int, found {self.pos!r}"
            )
        if self.pos < 0:
            raise SegmentError(f"InlineRows({self.field!r}).pos: expected >= 0, found {self.pos}")
        object.__setattr__(self, "pos", int(self.pos))
        if not isinstance(self.meta, MappingProxyType):
            object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    @property
    def rows(self) -> int:
        """Number of rows (token positions) covered."""
        return int(self.array.shape[0])

    @property
    def end(self) -> int:
        """One past the last position covered."""
        return self.pos + self.rows

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (routes: ``(layers, topk)``)."""
        return tuple(self.array.shape[1:])
