"""The payload file format: a small self-describing header, then fields back to back.

Layout (all integers little-endian)::

    0   8   magic b"R3PAYLD\\x00"
    8   4   format version (1)
    12  4   CRC-32C of the table
    16  8   table length T
    24  T   table: UTF-8 JSON {"version": k, "fields": [entry, ...]}
    ..      zero padding to a multiple of 64, then each field's bytes, each starting 64-aligned

An entry is a segment's dict without ``file`` (the name may change when files move) plus
``nbytes``, the byte count of the field's values, and ``crc32c`` of its data. A ragged field
stores its values at ``offset`` and its ``rows + 1`` int64 element offsets at ``index`` (8-aligned,
after the values). Offsets are absolute, so a segment taken from the table reads the file with no
knowledge of the header, exactly like the headerless files prime-rl's server writes.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import crc32c
import orjson

from r3data.errors import PayloadFormatError, SegmentError
from r3data.validate import checked_int
from r3data.wire.segment import INDEX_DTYPE, PayloadSegment

__all__ = [
    "DATA_ALIGN",
    "FORMAT_VERSION",
    "HEADER_READ_BYTES",
    "MAGIC",
    "MAX_TABLE_BYTES",
    "FieldEntry",
    "PayloadHeader",
    "checksum",
    "place_fields",
    "read_header",
    "starts_like_payload",
]

MAGIC = b"R3PAYLD\x00"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sIIQ")
DATA_ALIGN = 64
MAX_TABLE_BYTES = 64 << 20
"""A table larger than this is refused before it is read (a field table is a few KiB)."""
HEADER_READ_BYTES = 64 << 10
"""What a header parser reads at once: a file's header in one read (one request on a store)."""


def checksum(*parts: Any, value: int = 0) -> int:
    """CRC-32C of the buffers ``parts`` read one after another (continuing from ``value``)."""
    for part in parts:
        value = crc32c.crc32c(part, value)
    return value


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class FieldEntry:
    """One field of a payload file: its whole-field segment and the byte count of its values."""

    segment: PayloadSegment
    nbytes: int

    @property
    def byte_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` byte ranges holding the field: values, then a ragged field's index."""
        s = self.segment
        ranges = [(s.offset, s.offset + self.nbytes)]
        if s.ragged:
            ranges.append((s.index, s.index + s.nbytes))
        return ranges

    @property
    def end(self) -> int:
        """One past the field's last byte."""
        return self.byte_ranges[-1][1]

    def to_table(self) -> dict[str, Any]:
        entry = self.segment.to_dict()
        del entry["file"]
        entry["nbytes"] = self.nbytes
        return entry


@dataclass(frozen=True)
class PayloadHeader:
    """What a payload file says about itself."""

    format_version: int
    version: int
    fields: tuple[FieldEntry, ...]
    data_start: int

    def segments(self) -> list[PayloadSegment]:
        """One whole-field segment per field, in file order."""
        return [entry.segment for entry in self.fields]


def place_fields(
    version: int, drafts: Sequence[FieldEntry]
) -> tuple[bytes, tuple[FieldEntry, ...]]:
    """Assign byte offsets to ``drafts`` and encode the header that precedes them.

    The header holds the offsets and the offsets depend on the header's length, so placement
    repeats until the aligned data start stops moving (twice at most in practice).
    """
    start = _align(PREFIX.size, DATA_ALIGN)
    while True:
        placed = _placed(drafts, start)
        table = orjson.dumps({"version": version, "fields": [e.to_table() for e in placed]})
        needed = _align(PREFIX.size + len(table), DATA_ALIGN)
        if needed <= start:
            break
        start = needed
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, checksum(table), len(table))
    padding = bytes(start - PREFIX.size - len(table))
    return prefix + table + padding, placed


def _placed(drafts: Sequence[FieldEntry], start: int) -> tuple[FieldEntry, ...]:
    cursor = start
    placed = []
    for draft in drafts:
        offset = cursor
        cursor += draft.nbytes
        moved: dict[str, int] = {"offset": offset}
        if draft.segment.ragged:
            moved["index"] = _align(cursor, INDEX_DTYPE.itemsize)
            cursor = moved["index"] + draft.segment.nbytes
        placed.append(replace(draft, segment=replace(draft.segment, **moved)))
        cursor = _align(cursor, DATA_ALIGN)
    return tuple(placed)


def starts_like_payload(head: bytes) -> bool:
    """Whether ``head``, a file's first ``len(MAGIC)`` bytes (fewer for a shorter file), starts
    an r3data payload file: the magic, or the magic cut short (a payload file truncated inside
    it). Anything else is another file, e.g. a headerless raw file."""
    return head == MAGIC or (bool(head) and MAGIC.startswith(head))


def read_header(f: BinaryIO, file: str) -> PayloadHeader:
    """Parse and check the header of the open payload file ``f`` (named ``file`` in messages).

    Raises :class:`PayloadFormatError` for a file without the magic (e.g. a headerless raw file),
    a table that is too large, corrupt or inconsistent, or a field that reaches past the end.
    """
    size = f.seek(0, 2)
    f.seek(0)
    prefix = f.read(PREFIX.size)
    if prefix.startswith(MAGIC) and len(prefix) < PREFIX.size:
        raise PayloadFormatError(
            f"{file}: expected an r3data payload header of at least {PREFIX.size} bytes after "
            f"its magic {MAGIC!r}, found a {size}-byte file (cut short)"
        )
    if not prefix.startswith(MAGIC):
        raise PayloadFormatError(
            f"{file}: expected an r3data payload header starting with {MAGIC!r}, found "
            f"{prefix[: len(MAGIC)]!r} (a headerless raw file can only be read through segments)"
        )
    _, format_version, table_crc, table_len = PREFIX.unpack(prefix)
    if format_version != FORMAT_VERSION:
        raise PayloadFormatError(
            f"{file}: expected payload format version {FORMAT_VERSION}, found {format_version}"
        )
    if table_len > min(MAX_TABLE_BYTES, size - PREFIX.size):
        raise PayloadFormatError(
            f"{file}: header table claims {table_len} bytes; the file has {size} bytes and a "
            f"table may hold at most {MAX_TABLE_BYTES}"
        )
    table = f.read(table_len)
    if len(table) != table_len or checksum(table) != table_crc:
        raise PayloadFormatError(
            f"{file}: header table checksum mismatch: expected crc32c {table_crc:#010x}, found "
            f"{checksum(table):#010x} over {len(table)} of {table_len} bytes"
        )
    return _parse_table(table, file, size, format_version)


def _parse_table(table: bytes, file: str, size: int, format_version: int) -> PayloadHeader:
    try:
        parsed = orjson.loads(table)
    except orjson.JSONDecodeError as exc:
        raise PayloadFormatError(f"{file}: header table is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("fields"), list):
        raise PayloadFormatError(f"{file}: header table must be an object with a 'fields' list")
    version = parsed.get("version")
    checked_int(f"{file}: header version", version, error=PayloadFormatError)
    data_start = _align(PREFIX.size + len(table), DATA_ALIGN)
    entries = tuple(_parse_entry(raw, file, size, data_start) for raw in parsed["fields"])
    names = [entry.segment.field for entry in entries]
    if len(set(names)) != len(names):
        raise PayloadFormatError(f"{file}: header lists a field twice: {names}")
    _check_apart(entries, file)
    return PayloadHeader(format_version, version, entries, data_start)


def _check_apart(entries: tuple[FieldEntry, ...], file: str) -> None:
    """Refuse fields whose byte ranges (a ragged field's values and index included) overlap: a
    writer never shares bytes, so one byte would be checked, and read, as two things."""
    ranges = sorted(
        (start, stop, entry.segment.field)
        for entry in entries
        for start, stop in entry.byte_ranges
        if stop > start
    )
    for (start, stop, field), (next_start, next_stop, next_field) in itertools.pairwise(ranges):
        if next_start < stop:
            raise PayloadFormatError(
                f"{file}: expected fields' bytes apart, found field {field!r} at [{start}, "
                f"{stop}) and field {next_field!r} at [{next_start}, {next_stop}), which overlap"
            )


def _parse_entry(raw: Any, file: str, size: int, data_start: int) -> FieldEntry:
    if not isinstance(raw, dict):
        raise PayloadFormatError(f"{file}: field entry must be an object, found {raw!r:.80}")
    nbytes = raw.get("nbytes")
    checked_int(f"{file}: field entry nbytes", nbytes, error=PayloadFormatError)
    if raw.get("crc32c") is None:
        raise PayloadFormatError(f"{file}: field entry {raw.get('field')!r} has no crc32c")
    try:
        segment = PayloadSegment.from_dict({**raw, "file": file})
    except SegmentError as exc:
        raise PayloadFormatError(f"{file}: bad field entry: {exc}") from None
    entry = FieldEntry(segment, nbytes)
    expected = nbytes if segment.ragged else segment.nbytes
    if nbytes != expected or nbytes % segment.itemsize:
        raise PayloadFormatError(
            f"{file}: field {segment.field!r}: {segment.rows} rows of {segment.dtype} "
            f"{segment.shape} need {expected} bytes, entry says {nbytes}"
        )
    for start, stop in entry.byte_ranges:
        if start < data_start or stop > size:
            raise PayloadFormatError(
                f"{file}: field {segment.field!r} claims bytes [{start}, {stop}); data lies in "
                f"[{data_start}, {size})"
            )
    return entry
