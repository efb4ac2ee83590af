"""Offline checks of payload files: ``inspect`` one bare file, ``verify`` a whole root."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import numpy as np
from fsspec import AbstractFileSystem

from r3data.errors import (
    PayloadChecksumError,
    PayloadError,
    PayloadFormatError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
)
from r3data.parallel import fill_rows, io_workers
from r3data.payload.fileformat import (
    HEADER_READ_BYTES,
    MAGIC,
    FieldEntry,
    PayloadHeader,
    checksum,
    read_header,
    starts_like_payload,
)
from r3data.payload.fs import DEFAULT_TIMEOUT_S, PayloadRoot, open_file
from r3data.payload.retention import VERSION_DIR, min_fresh_version
from r3data.payload.writer import TEMP_SUFFIX
from r3data.wire.segment import INDEX_DTYPE

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


def inspect(
    path: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None
) -> PayloadFileInfo:
    """Read the header of one payload file (a path or fsspec URL) without reading its data.

    Raises :class:`PayloadFormatError` for a headerless or malformed file, and
    :class:`~r3data.errors.PayloadHandleError` for a FIFO, device or directory (refused before
    it is opened: reading one would block).
    """
    shown = os.fspath(path)
    with open_file(shown, fs) as file:
        return PayloadFileInfo(shown, file.size, read_header(file.stream(HEADER_READ_BYTES), shown))


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
        # steps compared, not differenced: a difference wraps around int64 and hides a fall
        if index[0] != 0 or index[-1] != elements or (index[1:] < index[:-1]).any():
            raise PayloadFormatError(
                f"{file}: ragged index of field {s.field!r} must rise from 0 to {elements}, "
                f"found {index.tolist()[:8]}..."
            )


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found under a root. ``ok`` means no corrupt and no unreadable file.

    ``files_checked`` counts every file whose header and checksums were checked, corrupt ones
    included. ``corrupt`` and ``unreadable`` map a file to what is wrong with it (``unreadable``:
    refused before reading, e.g. a symlink out of the root or a FIFO, or not permitted).
    ``headerless`` files (prime-rl's raw layout) cannot be checked without their segments;
    ``temporary`` files are left by writers that died before publishing; ``orphans`` lie outside
    any ``v<k>`` directory; ``stale_versions`` are older than the off-policy bound, when given.
    Each file is named in one list at most. A file deleted while ``verify`` ran (retention at
    work) is not reported.
    """

    root: str
    files_checked: int
    bytes_checked: int
    versions: list[int]
    corrupt: dict[str, str]
    unreadable: dict[str, str]
    headerless: list[str]
    temporary: list[str]
    orphans: list[str]
    stale_versions: list[int]

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.unreadable

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


_OK, _HEADERLESS, _CORRUPT, _UNREADABLE, _GONE = "ok", "headerless", "corrupt", "unreadable", "gone"


def _check_file(root: PayloadRoot, name: str) -> tuple[str, str]:
    """``(outcome, what is wrong)`` for the root-relative file ``name``."""
    try:
        with root.open_read(name) as file:
            f = file.stream(HEADER_READ_BYTES)
            head = f.read(len(MAGIC))
            if not starts_like_payload(head):  # a cut magic is corrupt, not headerless
                return _HEADERLESS, ""
            for entry in read_header(f, name).fields:
                _check_field(f, entry, name)
    except PayloadNotFoundError:
        return _GONE, ""
    except (PayloadHandleError, PayloadPermissionError) as exc:
        return _UNREADABLE, str(exc)
    except PayloadError as exc:
        return _CORRUPT, str(exc).removeprefix(f"{name}: ")  # the report names the file
    return _OK, ""


def verify(
    root: str | os.PathLike[str],
    *,
    fs: AbstractFileSystem | None = None,
    step: int | None = None,
    max_off_policy_steps: int | None = None,
    workers: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> VerifyReport:
    """Walk ``root``, checking every payload file's header and checksums (files in parallel).

    Files are opened through the root's confinement: a symlink out of the root, a FIFO or a
    device is listed as unreadable, never followed or opened. With ``step`` and
    ``max_off_policy_steps``, versions below ``min_fresh_version(step + 1,
    max_off_policy_steps)`` are reported as stale. Only files are looked at: whether a store
    still lists an emptied directory (SeaweedFS does for a while, AWS does not) changes nothing.
    ``timeout`` bounds each call to a root that is not local-backed
    (:data:`~r3data.payload.deadline.DEFAULT_TIMEOUT_S`; None: no limit).
    """
    payload_root = PayloadRoot(root, fs, timeout=timeout)
    payload_root.require()
    payload_root.fs.invalidate_cache(payload_root.path)
    files = sorted(
        payload_root.files(payload_root.call("find", payload_root.path, detail=True).values())
    )
    versions: set[int] = set()
    checked: list[tuple[str, int]] = []
    temporary, orphans = [], []
    for name, size in files:
        folder, _, base = name.partition("/")
        match = VERSION_DIR.fullmatch(folder)
        if match is None or not base or "/" in base:
            orphans.append(name)
        else:
            versions.add(int(match.group(1)))
            is_temp = base.startswith(".") and base.endswith(TEMP_SUFFIX)
            (temporary.append(name) if is_temp else checked.append((name, size)))
    results = fill_rows(
        lambda i: _check_file(payload_root, checked[i][0]),
        len(checked),
        io_workers() if workers is None else workers,
    )
    outcomes: dict[str, dict[str, str]] = {}
    checked_bytes = 0
    for (name, size), (outcome, message) in zip(checked, results, strict=True):
        outcomes.setdefault(outcome, {})[name] = message
        if outcome in (_OK, _CORRUPT):
            checked_bytes += size
    stale: list[int] = []
    if step is not None and max_off_policy_steps is not None:
        bound = min_fresh_version(step + 1, max_off_policy_steps)
        stale = sorted(v for v in versions if v < bound)
    return VerifyReport(
        root=payload_root.url,
        files_checked=len(outcomes.get(_OK, {})) + len(outcomes.get(_CORRUPT, {})),
        bytes_checked=checked_bytes,
        versions=sorted(versions),
        corrupt=outcomes.get(_CORRUPT, {}),
        unreadable=outcomes.get(_UNREADABLE, {}),
        headerless=list(outcomes.get(_HEADERLESS, {})),
        temporary=temporary,
        orphans=orphans,
        stale_versions=stale,
    )
