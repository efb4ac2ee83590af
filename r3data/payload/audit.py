"""Offline checks of payload files: ``inspect`` one bare file, ``verify`` a whole root."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import fsspec
import numpy as np
from fsspec import AbstractFileSystem

from r3data.errors import (
    PayloadChecksumError,
    PayloadError,
    PayloadFormatError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
)
from r3data.parallel import fill_rows, io_workers
from r3data.payload.fileformat import MAGIC, FieldEntry, PayloadHeader, checksum, read_header
from r3data.payload.fs import PayloadRoot
from r3data.payload.retention import VERSION_DIR, min_fresh_version
from r3data.payload.segment import INDEX_DTYPE
from r3data.payload.writer import TEMP_SUFFIX

__all__ = ["PayloadFileInfo", "VerifyReport", "inspect", "verify"]

CHUNK_BYTES = 8 << 20
"""Checksums stream through buffers of this size, whatever the field size."""


@dataclass(frozen=True)
class PayloadFileInfo:
    """A payload file's header: its policy version and fields (as whole-field segments)."""

    file: str
    size: int
    header: PayloadHeader

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "size": self.size,
            "format_version": self.header.format_version,
            "version": self.header.version,
            "fields": [{**e.segment.to_dict(), "nbytes": e.nbytes} for e in self.header.fields],
        }


def _open(fs: AbstractFileSystem, path: str, shown: str) -> BinaryIO:
    try:
        return fs.open(path, "rb")
    except FileNotFoundError as exc:
        raise PayloadNotFoundError(f"payload file {shown} does not exist") from exc
    except PermissionError as exc:
        raise PayloadPermissionError(f"payload file {shown} may not be read: {exc}") from exc
    except OSError as exc:
        raise PayloadReadError(f"opening payload file {shown}: {exc}") from exc


def inspect(
    path: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None
) -> PayloadFileInfo:
    """Read the header of one payload file (a path or fsspec URL) without reading its data.

    Raises :class:`PayloadFormatError` for a headerless or malformed file.
    """
    shown = os.fspath(path)
    if fs is None:
        fs, inner = fsspec.core.url_to_fs(shown)
    else:
        inner = fs._strip_protocol(shown)
    with _open(fs, inner, shown) as f:
        header = read_header(f, shown)
        return PayloadFileInfo(shown, f.seek(0, 2), header)


def _check_field(f: BinaryIO, entry: FieldEntry, file: str) -> None:
    """Recompute the field's checksum; for a ragged field also check its index table."""
    s = entry.segment
    crc = 0
    for start, stop in entry.byte_ranges:
        f.seek(start)
        for lo in range(start, stop, CHUNK_BYTES):
            wanted = min(CHUNK_BYTES, stop - lo)
            chunk = f.read(wanted)
            if len(chunk) != wanted:
                raise PayloadReadError(
                    f"{file}: short read in field {s.field!r}: wanted {wanted} bytes at offset "
                    f"{lo}, got {len(chunk)}"
                )
            crc = checksum(chunk, value=crc)
    if crc != s.crc32c:
        raise PayloadChecksumError(
            f"{file}: field {s.field!r} bytes {entry.byte_ranges}: expected crc32c "
            f"{s.crc32c:#010x}, found {crc:#010x}"
        )
    if s.ragged:
        f.seek(s.index)
        index = np.frombuffer(f.read(s.nbytes), INDEX_DTYPE)
        elements = entry.nbytes // s.itemsize
        if index[0] != 0 or index[-1] != elements or (np.diff(index) < 0).any():
            raise PayloadFormatError(
                f"{file}: ragged index of field {s.field!r} must rise from 0 to {elements}, "
                f"found {index.tolist()[:8]}..."
            )


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found under a root. ``ok`` means no corrupt file.

    ``headerless`` files (prime-rl's raw layout) cannot be checked without their segments;
    ``temporary`` files are left by writers that died before publishing; ``orphans`` lie outside
    any ``v<k>`` directory; ``stale_versions`` are older than the off-policy bound, when given.
    """

    root: str
    files_checked: int
    bytes_checked: int
    versions: list[int]
    corrupt: dict[str, str]
    headerless: list[str]
    temporary: list[str]
    orphans: list[str]
    stale_versions: list[int]

    @property
    def ok(self) -> bool:
        return not self.corrupt

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _check_file(fs: AbstractFileSystem, path: str, name: str) -> str | None:
    """``"headerless"``, an error message, or None for a file whose header and data check out."""
    try:
        with _open(fs, path, name) as f:
            if f.read(len(MAGIC)) != MAGIC:
                return "headerless"
            header = read_header(f, name)
            for entry in header.fields:
                _check_field(f, entry, name)
    except PayloadError as exc:
        return str(exc)
    return None


def verify(
    root: str | os.PathLike[str],
    *,
    fs: AbstractFileSystem | None = None,
    step: int | None = None,
    max_off_policy_steps: int | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Walk ``root``, checking every payload file's header and checksums (files in parallel).

    With ``step`` and ``max_off_policy_steps``, versions below
    ``min_fresh_version(step + 1, max_off_policy_steps)`` are reported as stale.
    """
    payload_root = PayloadRoot(root, fs)
    payload_root.require()
    listed = payload_root.fs.find(payload_root.path, detail=True)
    files = sorted(
        (payload_root.name_of(p), int(info.get("size") or 0)) for p, info in listed.items()
    )
    versions: set[int] = set()
    checked: list[tuple[str, int]] = []
    temporary, orphans = [], []
    for name, size in files:
        folder, _, base = name.partition("/")
        match = VERSION_DIR.fullmatch(folder)
        if match is None or "/" in base:
            orphans.append(name)
        else:
            versions.add(int(match.group(1)))
            is_temp = base.startswith(".") and base.endswith(TEMP_SUFFIX)
            (temporary.append(name) if is_temp else checked.append((name, size)))
    results = fill_rows(
        lambda i: _check_file(payload_root.fs, payload_root.full(checked[i][0]), checked[i][0]),
        len(checked),
        io_workers() if workers is None else workers,
    )
    corrupt = {
        name: r
        for (name, _), r in zip(checked, results, strict=True)
        if r not in (None, "headerless")
    }
    headerless = [name for (name, _), r in zip(checked, results, strict=True) if r == "headerless"]
    stale: list[int] = []
    if step is not None and max_off_policy_steps is not None:
        bound = min_fresh_version(step + 1, max_off_policy_steps)
        stale = sorted(v for v in versions if v < bound)
    return VerifyReport(
        root=payload_root.url,
        files_checked=sum(1 for r in results if r is None),
        bytes_checked=sum(size for (_, size), r in zip(checked, results, strict=True) if r is None),
        versions=sorted(versions),
        corrupt=corrupt,
        headerless=headerless,
        temporary=temporary,
        orphans=orphans,
        stale_versions=stale,
    )
