"""``PayloadSegment``: a handle to a run of rows of one field inside a payload file.

Field names follow prime-rl's by-handle payloads (``field, file, offset, pos, rows, dtype,
shape``; ``shape`` is the per-row shape, ``pos`` the first token position). Two optional
extensions: ``index`` marks a ragged field (e.g. sampling masks) whose per-row element offsets
live in the file, so a segment can be clipped without knowing row widths; ``crc32c`` is a
CRC-32C of exactly the segment's bytes (ragged: its values, then its index table). Clipping
drops the checksum, since it no longer describes the bytes named.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from r3data.errors import SegmentError, WireFormatError
from r3data.validate import INT64_MAX, checked_int
from r3data.wire.dtypes import parse_dtype

__all__ = ["INDEX_DTYPE", "PayloadSegment", "clip", "covers", "gaps", "shift"]

INDEX_DTYPE = np.dtype("<i8")
"""Ragged fields: ``rows + 1`` little-endian int64 element offsets, relative to ``offset``."""

REQUIRED_KEYS = ("field", "file", "offset", "pos", "rows", "dtype", "shape")
"""The keys of a prime-rl by-handle segment."""


CRC32C_MAX = 2**32 - 1


def _check_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    return checked_int(
        f"segment {name}", value, minimum=minimum, maximum=maximum, error=SegmentError
    )


def _canonical_dtype(name: Any) -> str:
    try:
        return _dtype_name(name) if isinstance(name, str) else parse_dtype(name).name
    except WireFormatError as exc:
        raise SegmentError(f"segment {exc}") from None


@functools.lru_cache(maxsize=64)
def _dtype_name(name: str) -> str:
    """The canonical name of a dtype name from the wire (cached: every handle names one)."""
    return parse_dtype(name).name


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class PayloadSegment:
    """Rows ``[pos, pos + rows)`` of ``field``, stored at byte ``offset`` of ``file``."""

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: tuple[int, ...] = ()
    index: int | None = None
    crc32c: int | None = field(default=None, compare=False)
    # Derived once from the fields above (the loader reads them for every piece of a batch);
    # ``_derived`` keeps them in step with the positions and counts it changes.
    ragged: bool = field(init=False, repr=False, compare=False)
    """Rows of varying width, located through the index table at byte ``index``."""
    end: int = field(init=False, repr=False, compare=False)
    """One past the last token position."""
    row_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The per-row shape (``shape``, prime-rl's name), as ``InlineRows.row_shape``."""
    itemsize: int = field(init=False, repr=False, compare=False)
    """Bytes of one element."""
    row_bytes: int = field(init=False, repr=False, compare=False)
    """Bytes of one fixed-width row (of one element for ragged segments)."""
    nbytes: int = field(init=False, repr=False, compare=False)
    """Bytes this handle names directly: the rows, or for a ragged field the index table."""

    def __post_init__(self) -> None:
        for name in ("field", "file"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "\x00" in value:
                raise SegmentError(f"segment {name} must be a non-empty string, found {value!r}")
        object.__setattr__(self, "offset", _check_int("offset", self.offset, 0, INT64_MAX))
        for name in ("pos", "rows"):
            object.__setattr__(self, name, _check_int(name, getattr(self, name)))
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        if isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__iter__"):
            raise SegmentError(f"segment shape must be a list of ints, found {self.shape!r}")
        shape = tuple(_check_int("shape entry", d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if self.index is not None:
            object.__setattr__(self, "index", _check_int("index", self.index, 0, INT64_MAX))
            if shape:
                raise SegmentError(
                    f"ragged segment of {self.field!r} must have row shape (), found {shape}"
                )
        if self.crc32c is not None:
            object.__setattr__(self, "crc32c", _check_int("crc32c", self.crc32c, 0, CRC32C_MAX))
        itemsize = _itemsize(self.dtype)
        self.__dict__.update(
            ragged=self.index is not None,
            row_shape=shape,
            itemsize=itemsize,
            row_bytes=itemsize * math.prod(shape),
        )
        _count(self.__dict__)
        start = self.offset if self.index is None else self.index
        if start + self.nbytes > INT64_MAX:  # a file offset is an int64 to the system calls
            raise SegmentError(
                f"segment of {self.field!r}: expected bytes that end by {INT64_MAX}, found "
                f"bytes [{start}, {start + self.nbytes})"
            )

    def to_dict(self) -> dict[str, Any]:
        """prime-rl's field names; the optional extensions appear only when set."""
        out: dict[str, Any] = {
            "field": self.field,
            "file": self.file,
            "offset": self.offset,
            "pos": self.pos,
            "rows": self.rows,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.index is not None:
            out["index"] = self.index
        if self.crc32c is not None:
            out["crc32c"] = self.crc32c
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PayloadSegment:
        """Validate a handle from the wire (unknown keys are ignored for forward compatibility)."""
        if not isinstance(data, Mapping):
            raise SegmentError(f"segment must be a JSON object, found {type(data).__name__}")
        missing = [name for name in REQUIRED_KEYS if name not in data]
        if missing:
            raise SegmentError(f"segment must have keys {list(REQUIRED_KEYS)}, missing {missing}")
        if not isinstance(data["shape"], (list, tuple)):
            raise SegmentError(f"segment shape must be a list of ints, found {data['shape']!r}")
        optional = {name: data[name] for name in _OPTIONAL_KEYS if data.get(name) is not None}
        return cls(**{name: data[name] for name in REQUIRED_KEYS}, **optional)

    def clipped(self, lo: int, hi: int) -> PayloadSegment | None:
        """The part of this segment inside positions ``[lo, hi)``, or None when empty."""
        start, stop = max(lo, self.pos), min(hi, self.end)
        if stop <= start:
            return None
        if (start, stop) == (self.pos, self.end):
            return self
        skipped = start - self.pos
        if self.ragged:
            moved = {"index": self.index + skipped * INDEX_DTYPE.itemsize}
        else:
            moved = {"offset": self.offset + skipped * self.row_bytes}
        return self._derived(pos=start, rows=stop - start, crc32c=None, **moved)

    def _derived(self, **changes: int | None) -> PayloadSegment:
        """A copy with ``changes``: positions, counts and byte offsets computed from this
        validated segment (each an int within its bounds by construction), so not checked
        again; clipping thousands of handles per batch would otherwise validate each twice."""
        derived = object.__new__(PayloadSegment)
        derived.__dict__.update(self.__dict__, **changes)
        _count(derived.__dict__)
        return derived


def _count(values: dict[str, Any]) -> None:
    """Set ``end`` and ``nbytes`` in a segment's attribute ``values`` from its ``pos`` and
    ``rows`` (and ``ragged``, ``row_bytes``)."""
    rows = values["rows"]
    values["end"] = values["pos"] + rows
    values["nbytes"] = (
        (rows + 1) * INDEX_DTYPE.itemsize if values["ragged"] else rows * values["row_bytes"]
    )


_OPTIONAL_KEYS = tuple(
    f.name for f in fields(PayloadSegment) if f.init and f.name not in REQUIRED_KEYS
)


def clip(segments: list[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """Segments restricted to positions ``[lo, hi)``; empty ones are dropped."""
    _check_range("clip", lo, hi)
    lo, hi = int(lo), int(hi)  # numpy bounds would leak into the handles (and their JSON)
    return [part for s in segments if (part := s.clipped(lo, hi)) is not None]


def _check_range(what: str, lo: int, hi: int) -> None:
    for value in (lo, hi):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise SegmentError(f"{what} bounds must be ints, found {value!r}")
    if lo < 0 or hi < lo:
        raise SegmentError(f"{what} range must satisfy 0 <= lo <= hi, found [{lo}, {hi})")


def shift(segments: list[PayloadSegment], delta: int) -> list[PayloadSegment]:
    """Segments moved by ``delta`` token positions (bytes stay where they are)."""
    if isinstance(delta, bool) or not isinstance(delta, (int, np.integer)):
        raise SegmentError(f"shift delta must be an int, found {delta!r}")
    for s in segments:
        if s.pos + delta < 0:
            raise SegmentError(
                f"shift by {delta} moves segment of {s.field!r} at pos {s.pos} below 0"
            )
    return [s._derived(pos=s.pos + int(delta)) for s in segments]


def gaps(segments: list[PayloadSegment], field: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """Ranges inside ``[lo, hi)`` that no segment of ``field`` covers, in order."""
    _check_range("gaps", lo, hi)
    spans = sorted((s.pos, s.end) for s in segments if s.field == field and s.rows)
    missing: list[tuple[int, int]] = []
    cursor = lo
    for start, stop in spans:
        if start > cursor and cursor < hi:
            missing.append((cursor, min(start, hi)))
        cursor = max(cursor, stop)
        if cursor >= hi:
            break
    if cursor < hi:
        missing.append((cursor, hi))
    return missing


def covers(segments: list[PayloadSegment], field: str, lo: int, hi: int) -> bool:
    """Whether the segments of ``field`` cover every position in ``[lo, hi)``."""
    return not gaps(segments, field, lo, hi)
