"""``PayloadWriter``: publish several fields as one self-describing payload file, atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from r3data.errors import PayloadHandleError, PayloadWriteError, SegmentError
from r3data.payload.deadline import DEFAULT_TIMEOUT_S, bounded, on_event_loop, within
from r3data.payload.fileformat import FieldEntry, checksum, place_fields
from r3data.payload.fs import PayloadRoot
from r3data.payload.ragged import as_ragged, host_array
from r3data.ragged import RaggedRows
from r3data.validate import checked_int
from r3data.wire.segment import INDEX_DTYPE, PayloadSegment

__all__ = ["CLEANUP_HORIZON_S", "FieldData", "PayloadWriter", "TEMP_SUFFIX"]

logger = logging.getLogger(__name__)

FieldData = np.ndarray | RaggedRows | tuple[Any, Any] | Sequence[Any]
"""A fixed-width field is an array ``[rows, *row_shape]`` (numpy or CPU torch); a ragged field
is ``(values, row_lengths)`` (or :class:`RaggedRows`) or a list of 1-D arrays, one per row."""

TEMP_SUFFIX = ".tmp"
"""Files being written are named ``.<id>.bin.tmp`` next to their final name."""

_STREAM_CHUNK = 8 << 20
"""Bytes per write into an object store's file when it does not say its block size."""

CLEANUP_HORIZON_S = 15 * 60.0
"""How long a failed upload whose abort the store did not answer is tried again (abort, then
delete the final name), in the background: a request held in the network past its
cancellation (a completion the store takes once it answers again) could otherwise publish
the file after its writer was told it failed. S3 refuses a request signed more than 15
minutes before it arrives."""

MAX_PENDING_CLEANUPS = 1024
"""Failed uploads waiting for their abort at once; past it the oldest is given up (logged)."""

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
    the final name (see :func:`_upload`). A local-backed root's calls are system calls, bounded
    by the mount's own options, as for the readers.
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
                data = b"".join(map(_byte_view, parts))
                put = partial(fs.pipe_file, final, data)
                within(root.timeout, f"putting {url}", put, fs, late=_removal(root, final))
            else:
                _upload(root, final, url, parts)
        except BaseException as exc:
            _remove_quietly(root, final)
            if isinstance(exc, Exception):  # a client library's own errors fail a write too
                raise PayloadWriteError(f"writing payload file {url}: {exc}") from exc
            raise


def _remove_quietly(root: PayloadRoot, path: str) -> None:
    """Delete ``path`` if a failed write left it (a filesystem that shows files while they are
    written, a publish that completed after its deadline), each call bounded by the root's
    timeout; a failure to look or delete is not the error to report."""
    with contextlib.suppress(Exception):
        if _published(root, path):
            root.call("rm_file", path)


def _published(root: PayloadRoot, path: str) -> bool:
    """Whether ``path`` exists now (no listing cached before a late publish hides it)."""
    root.fs.invalidate_cache(path)
    return bool(root.call("exists", path))


def _removal(root: PayloadRoot, path: str) -> Callable[[Any], None]:
    """What a publish abandoned at its deadline does if it completes after all (``late`` of
    :func:`~r3data.payload.deadline.within`): delete what it published."""
    return lambda _: _remove_quietly(root, path)


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


def _upload(root: PayloadRoot, path: str, url: str, parts: list[Any]) -> None:
    """Stream ``parts`` into one upload that the store publishes when the file closes.

    Object stores' fsspec files (s3fs, gcsfs, adlfs) buffer a block at a time (one put below
    the block size, a multipart upload above it) and make the object visible only at close: the
    file is never seen half-written, and the upload holds about a block, not a second copy of
    the file. On failure the upload is discarded and the file marked closed, so that nothing
    (not even garbage collection) completes it.

    With a timeout, each call is bounded: on an s3fs file every request it makes (creating the
    multipart upload, each part, the completion or the single put) runs on s3fs's event loop
    and is cancelled at its deadline (:func:`_bound_requests`), so an abandoned publish never
    completes later; on any other file the open, each block's write and the close run with
    :func:`~r3data.payload.deadline.within`, and a close abandoned at its deadline that
    completes after all has what it published deleted as it returns.
    """
    fs, timeout = root.fs, root.timeout
    out = within(timeout, f"opening {url}", partial(fs.open, path, "wb"), fs, late=_abandon)
    requests_bounded = timeout is not None and _bound_requests(out, timeout, url)

    def step(doing: str, call: Callable[[], Any], late: Callable[[Any], None] | None = None) -> Any:
        if requests_bounded:
            return call()  # each request the call makes has its own deadline
        return within(timeout, doing, call, fs, late=late)

    chunk = getattr(out, "blocksize", None) or _STREAM_CHUNK
    try:
        written = 0
        for part in parts:
            view = _byte_view(part)
            for start in range(0, len(view), chunk):
                piece = view[start : start + chunk]
                step(f"writing {url} at offset {written}", partial(out.write, piece))
                written += len(piece)
        step(f"publishing {url}", out.close, late=_removal(root, path))
    except BaseException:
        _abort(out, root, path, url, requests_bounded)
        raise


def _bound_requests(out: Any, timeout: float, url: str) -> bool:
    """Give each request of ``out``, an s3fs file (``S3File``), the deadline ``timeout``;
    False (nothing changed) for any other file.

    An ``S3File`` makes every request of an upload (create the multipart upload, upload each
    part, complete it, or the single ``put_object`` of a small file) through its ``_call_s3``,
    which runs s3fs's ``_call_s3`` coroutine on the filesystem's event loop with no deadline,
    for as long as botocore's and s3fs's retries add up to. This file's ``_call_s3`` (its own
    attribute: no other file or caller of the filesystem is touched) runs the same coroutine
    through :func:`~r3data.payload.deadline.bounded`, which cancels it at its deadline: the
    request's connection is closed, and nothing retries it later."""
    inner = getattr(out, "fs", None)
    if not callable(getattr(type(out), "_call_s3", None)) or inner is None:
        return False
    if on_event_loop(inner, "call_s3") is None:
        return False

    def request(method: str, *kwarglist: Any, **kwargs: Any) -> Any:
        extra = (out.s3_additional_kwargs, out._request_payer_kw)  # what S3File._call_s3 adds
        doing = f"{method} of {url}"
        return bounded(inner, timeout, doing, "call_s3", method, *extra, *kwarglist, **kwargs)

    out._call_s3 = request
    return True


def _abort(out: Any, root: PayloadRoot, path: str, url: str, requests_bounded: bool) -> None:
    """Discard the upload of ``out`` and mark the file closed, so that nothing completes it
    later; failures here are not the error to report.

    An s3fs multipart upload is aborted here, bounded by the root's timeout (``discard`` would
    wait without one); when the store does not confirm the abort, it is tried again in the
    background (:class:`_Cleanups`), then the final name deleted should a completion the
    network still held have published it."""
    timeout = root.timeout
    try:
        if requests_bounded:
            mpu, out.mpu = getattr(out, "mpu", None), None
            if mpu:
                abort = partial(_abort_upload, out.fs, timeout, url, out.bucket, out.key, mpu)
                try:
                    abort()
                except FileNotFoundError:  # gone: completed (then deleted) or aborted already
                    pass
                except Exception:
                    _cleanups.add(_Cleanup(url, abort, root, path))
            out.discard()
        else:
            within(timeout, f"aborting the upload of {url}", out.discard, root.fs)
    except Exception as exc:
        logger.debug("discarding the upload of %s: %s", url, exc)
    with contextlib.suppress(AttributeError):
        out.closed = True


def _abort_upload(
    fs: AbstractFileSystem, timeout: float | None, url: str, bucket: str, key: str, mpu: Any
) -> None:
    doing = f"aborting the upload of {url}"
    bounded(fs, timeout, doing, "abort_mpu", bucket, key, mpu["UploadId"])


class _Cleanup:
    """One failed upload whose abort the store did not confirm: ``abort`` (raises
    ``FileNotFoundError`` when the upload is gone), then delete ``path`` if it was published."""

    def __init__(self, url: str, abort: Callable[[], None], root: PayloadRoot, path: str) -> None:
        self.url, self.abort, self.root, self.path = url, abort, root, path
        self.until = time.monotonic() + CLEANUP_HORIZON_S

    def attempt(self) -> None:
        """Abort the upload and delete the final name if it was published; raises while the
        store does not confirm either."""
        if self.abort is not None:
            with contextlib.suppress(FileNotFoundError):
                self.abort()
            self.abort = None  # confirmed: from now on no completion can succeed
        if _published(self.root, self.path):  # completed before the abort: delete it
            self.root.call("rm_file", self.path)


class _Cleanups:
    """Failed uploads tried again on one daemon thread, every ``timeout`` (doubling to a
    minute) until confirmed or :data:`CLEANUP_HORIZON_S` passed; each call is bounded by its
    root's timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[_Cleanup] = []
        self._thread: threading.Thread | None = None

    def add(self, cleanup: _Cleanup) -> None:
        logger.warning(
            "the store did not confirm the abort of the upload of %s: tried again in the "
            "background for up to %g s",
            cleanup.url,
            CLEANUP_HORIZON_S,
        )
        with self._lock:
            self._pending.append(cleanup)
            if len(self._pending) > MAX_PENDING_CLEANUPS:
                dropped = self._pending.pop(0)
                logger.warning("giving up the cleanup of the upload of %s", dropped.url)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="r3data-writer-cleanup", daemon=True
                )
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        wait: float | None = None
        while True:
            with self._lock:
                pending = list(self._pending)
                if not pending:
                    self._thread = None
                    return
            first = min(cleanup.root.timeout or 1.0 for cleanup in pending)
            wait = first if wait is None else min(2 * wait, 60.0)
            time.sleep(wait)
            for cleanup in pending:
                try:
                    cleanup.attempt()
                except Exception as exc:
                    logger.debug("cleanup of the upload of %s: %s", cleanup.url, exc)
                    if time.monotonic() < cleanup.until:
                        continue
                    logger.warning("giving up the cleanup of the upload of %s", cleanup.url)
                with self._lock:
                    self._pending.remove(cleanup)


_cleanups = _Cleanups()


def _forget_cleanups_in_child() -> None:
    """In a forked child the parent's cleanup thread does not exist (its lock may be held)."""
    global _cleanups
    _cleanups = _Cleanups()


os.register_at_fork(after_in_child=_forget_cleanups_in_child)


def _abandon(out: Any) -> None:
    """A file opened after its caller gave up: discarded unpublished, never closed."""
    with contextlib.suppress(Exception):
        out.discard()
    with contextlib.suppress(AttributeError):
        out.closed = True


def _byte_view(buffer: np.ndarray | bytes) -> memoryview:
    if isinstance(buffer, np.ndarray):
        return memoryview(buffer.reshape(-1).view(np.uint8))
    return memoryview(buffer)


def _write_all(fd: int, buffer: np.ndarray | bytes) -> None:
    view = _byte_view(buffer)
    while view:
        view = view[os.write(fd, view) :]
