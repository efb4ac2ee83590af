"""``PayloadWriter``: publish several fields as one self-describing payload file, atomically."""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from r3data.errors import PayloadHandleError, PayloadWriteError, SegmentError
from r3data.payload.deadline import DEFAULT_TIMEOUT_S, within
from r3data.payload.fileformat import FieldEntry, checksum, place_fields
from r3data.payload.fs import PayloadRoot
from r3data.payload.ragged import as_ragged, host_array
from r3data.payload.upload import byte_view, removal, remove_quietly, upload
from r3data.ragged import RaggedRows
from r3data.validate import checked_int
from r3data.wire.segment import INDEX_DTYPE, PayloadSegment

__all__ = ["FieldData", "PayloadWriter", "TEMP_SUFFIX"]

FieldData = np.ndarray | RaggedRows | tuple[Any, Any] | Sequence[Any]
"""A fixed-width field is an array ``[rows, *row_shape]`` (numpy or CPU torch); a ragged field
is ``(values, row_lengths)`` (or :class:`RaggedRows`) or a list of 1-D arrays, one per row."""

TEMP_SUFFIX = ".tmp"
"""Files being written are named ``.<id>.bin.tmp`` next to their final name."""

MAX_NUMBER = 2**63 - 1
"""The largest version or position a header holds (its JSON integers are 64-bit)."""


class PayloadWriter:
    """Writes files ``<root>/v<version>/<id>.bin`` and returns segments that name them.

    A file is never visible under its final name until it is complete: on a local-backed root
    (any filesystem whose paths are OS paths, NFS and other mounts included) it is written to a
    temporary name in its version folder, fsynced and renamed, then the folder is fsynced, all
    relative to the folder's confined descriptor; on an object store it is streamed into one
    upload that the store publishes when the file closes (``memory://`` takes a single put).
    Whatever a failed write left is deleted, on every filesystem.

    On a filesystem that is not local-backed each call the writer makes (the folder's
    ``makedirs``, the upload of each block, the publish at close or the single put of a small
    file, the abort and deletion after a failure) is given up after ``timeout`` seconds
    (:data:`~r3data.payload.deadline.DEFAULT_TIMEOUT_S`; None: no limit), as the readers'
    calls are: a per-call bound, not a whole-file one. The write then raises
    :class:`PayloadWriteError` naming the file and the timeout, and nothing is published under
    the final name (see :func:`~r3data.payload.upload.upload`). A local-backed root's calls
    are system calls, bounded by the mount's own options, as for the readers.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fs: AbstractFileSystem | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ):
        self.root = PayloadRoot(root, fs, timeout=timeout)

    @property
    def timeout(self) -> float | None:
        """Seconds each call to a filesystem that is not local-backed may take (None: no
        limit)."""
        return self.root.timeout

    def __repr__(self) -> str:
        return f"PayloadWriter({self.root})"

    def write(
        self,
        version: int,
        fields: Mapping[str, FieldData],
        *,
        pos: int | Mapping[str, int] = 0,
    ) -> list[PayloadSegment]:
        """Write ``fields`` (name -> rows) produced by policy ``version``; one segment per field.

        ``pos`` is the first token position of every field, or a mapping with one per field
        (routes and masks of one request usually start at different positions). Segments carry
        the CRC-32C of their bytes and name the file relative to the root (``v3/<id>.bin``).
        """
        version = checked_int("payload version", version, maximum=MAX_NUMBER, error=SegmentError)
        if not isinstance(fields, Mapping) or not fields:
            raise SegmentError(
                f"fields must be a non-empty mapping of name -> rows, found {fields!r:.80}"
            )
        file = f"v{int(version)}/{uuid.uuid4().hex}.bin"
        drafts, buffers = zip(
            *(_draft(file, name, data, _first_pos(pos, name)) for name, data in fields.items()),
            strict=True,
        )
        header, placed = place_fields(int(version), drafts)
        parts: list[Any] = [header]
        cursor = len(header)
        for entry, field_buffers in zip(placed, buffers, strict=True):
            for (start, stop), buffer in zip(entry.byte_ranges, field_buffers, strict=True):
                parts.append(bytes(start - cursor))
                parts.append(buffer)
                cursor = stop
        if self.root.local_backed:
            self._publish_local(file, parts)
        else:
            self._publish_put(file, parts)
        return [entry.segment for entry in placed]

    def _publish_local(self, file: str, parts: list[Any]) -> None:
        """Write to a temporary name in the version folder, fsync, rename, fsync the folder: all
        relative to the folder's descriptor, which the root confines."""
        folder, name = posixpath.split(file)
        temp = f".{name}{TEMP_SUFFIX}"
        try:
            with self.root.open_directory(folder, create=True) as directory:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(temp, flags, 0o666, dir_fd=directory)
                try:
                    try:
                        for part in parts:
                            _write_all(fd, part)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.rename(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(temp, dir_fd=directory)
                    raise
                os.fsync(directory)
        except (OSError, PayloadHandleError) as exc:
            raise PayloadWriteError(
                f"writing payload file {self.root.url_of(file)}: {exc}"
            ) from exc

    def _publish_put(self, file: str, parts: list[Any]) -> None:
        """One put or one streamed upload, each call bounded by the root's timeout; whatever a
        failed write left is deleted."""
        root = self.root
        final = root.full(file)
        fs, url = root.fs, root.url_of(file)
        try:
            root.call("makedirs", posixpath.dirname(final), exist_ok=True)
            if isinstance(fs, MemoryFileSystem):
                # memory:// stores a file as soon as it is opened, so a streamed file would be
                # visible half-written; its store keeps the bytes anyway: one joined copy is all.
                # A put abandoned at its deadline that lands later is deleted as it lands.
                data = b"".join(map(byte_view, parts))
                put = partial(fs.pipe_file, final, data)
                within(root.timeout, f"putting {url}", put, fs, late=removal(root, final, url))
            else:
                upload(root, final, url, parts)
        except BaseException as exc:
            remove_quietly(root, final, url)
            if isinstance(exc, Exception):  # a client library's own errors fail a write too
                raise PayloadWriteError(f"writing payload file {url}: {exc}") from exc
            raise


def _first_pos(pos: int | Mapping[str, int], name: str) -> int:
    if isinstance(pos, Mapping):
        if name not in pos:
            raise SegmentError(
                f"pos must give a first position for field {name!r}, has {sorted(pos)}"
            )
        pos = pos[name]
    return checked_int(f"field {name!r} pos", pos, maximum=MAX_NUMBER, error=SegmentError)


def _draft(file: str, name: str, data: FieldData, pos: int) -> tuple[FieldEntry, list[Any]]:
    """The field's segment before placement (offsets 0) and the buffers that hold its bytes."""
    what = f"field {name!r}"
    if isinstance(name, str) and not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError:
            raise SegmentError(f"field name: expected UTF-8 text, found {name!r}") from None
    if isinstance(data, (tuple, list, RaggedRows)):
        ragged = as_ragged(data, what)
        index = ragged.offsets.astype(INDEX_DTYPE)
        segment = PayloadSegment(
            name,
            file,
            0,
            pos,
            ragged.rows,
            ragged.values.dtype.name,
            (),
            index=0,
            crc32c=checksum(ragged.values, index),
        )
        return FieldEntry(segment, ragged.values.nbytes), [ragged.values, index]
    array = host_array(data, what)
    if array.ndim < 1:
        raise SegmentError(f"{what}: expected rows first (at least 1-D), found a scalar")
    segment = PayloadSegment(
        name,
        file,
        0,
        pos,
        array.shape[0],
        array.dtype.name,
        array.shape[1:],
        crc32c=checksum(array),
    )
    return FieldEntry(segment, array.nbytes), [array]


def _write_all(fd: int, buffer: np.ndarray | bytes) -> None:
    view = byte_view(buffer)
    while view:
        view = view[os.write(fd, view) :]
