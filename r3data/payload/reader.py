"""``PayloadReader``: rows named by segments, read from payload files into arrays or caller buffers.

Segments are grouped by file; each file is opened once and its ranges read in offset order;
files are read concurrently on the shared I/O pool. Local files are read with ``os.preadv``
straight into the destination, any other fsspec filesystem through its file's ``readinto``.
A read that comes up short (a file not yet fully visible on a network filesystem, a flaky
backend) reopens the file and resumes, with doubling backoff, before giving up.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem

from r3data.errors import (
    ConfigError,
    PayloadChecksumError,
    PayloadFormatError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
    SegmentError,
)
from r3data.parallel import fill_rows, io_workers
from r3data.payload.fileformat import checksum
from r3data.payload.fs import PayloadFile, PayloadRoot
from r3data.payload.ragged import RaggedRows
from r3data.payload.segment import INDEX_DTYPE, PayloadSegment

__all__ = ["PayloadReader", "ReadJob"]

ReadJob = tuple[Sequence[PayloadSegment], Any]
"""Segments of one fixed-width field and the buffer (numpy array or CPU tensor) their rows fill."""


@dataclass(eq=False)
class _Request:
    """``nbytes`` at ``offset`` of ``segment.file`` into ``dest`` (allocated after a size check
    when None). ``crc``, when given, is checked over ``dest`` followed by ``crc_tail``;
    ``crc_running`` is the checksum of the bytes read so far."""

    segment: PayloadSegment
    offset: int
    nbytes: int
    dest: memoryview | None = None
    crc: int | None = None
    crc_tail: bytes = b""
    crc_running: int = 0

    def allocate(self) -> None:
        self.dest = memoryview(np.empty(self.nbytes, np.uint8))

    def array(self) -> np.ndarray:
        return np.frombuffer(self.dest, np.uint8)


_CHECKSUM_CHUNK = 1 << 20
"""Bytes per local read when checksumming: each piece is checksummed while in the CPU cache
(a read on any other filesystem may cost a round trip: one read per range there)."""


def _fill(handle: PayloadFile, r: _Request, got: int) -> int:
    """Read ``r`` from byte ``got`` on until it is full or the file ends; returns bytes held."""
    local = r.crc is not None and handle.fd is not None
    step = _CHECKSUM_CHUNK if local else r.nbytes
    while got < r.nbytes:
        n = handle.read_at(r.offset + got, r.dest[got : min(got + step, r.nbytes)])
        if not n:
            break
        if r.crc is not None:
            r.crc_running = checksum(r.dest[got : got + n], value=r.crc_running)
        got += n
    return got


class PayloadReader:
    """Reads segments' rows from files under ``root`` (a path or fsspec URL; or a path in ``fs``).

    ``workers`` bounds the files read at once (default :func:`r3data.parallel.io_workers`). A
    short read or I/O error is retried ``retries`` times, reopening the file, after ``backoff``
    seconds doubling up to ``max_backoff``. Segments carrying ``crc32c`` are verified.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fs: AbstractFileSystem | None = None,
        workers: int | None = None,
        retries: int = 4,
        backoff: float = 0.1,
        max_backoff: float = 0.8,
    ) -> None:
        self.root = PayloadRoot(root, fs)
        self.workers = io_workers() if workers is None else workers
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers must be an int >= 1, found {workers!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be an int >= 0, found {retries!r}")
        if not 0 <= backoff <= max_backoff:
            raise ConfigError(
                f"backoff must satisfy 0 <= backoff <= max_backoff, found {backoff} and {max_backoff}"
            )
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    def __repr__(self) -> str:
        return f"PayloadReader({self.root}, workers={self.workers}, retries={self.retries})"

    def files(self, segments: Iterable[PayloadSegment]) -> list[str]:
        """The files (relative to the root, normalised) that reading ``segments`` touches."""
        return sorted({self.root.relative(s.file) for s in segments})

    def read(self, segments: Iterable[PayloadSegment]) -> dict[str, np.ndarray | RaggedRows]:
        """Rows of every field, segments of a field concatenated in the order given.

        A fixed-width field comes back as ``[rows, *shape]``; a ragged one as
        :class:`RaggedRows` ``(values, row_lengths)``. Each segment is allocated after its file
        proved large enough; for one copy into a batch buffer use :meth:`read_into`.
        """
        by_field: dict[str, list[PayloadSegment]] = {}
        for s in segments:
            _check_same_kind(by_field.setdefault(s.field, []), s).append(s)
        fixed = {
            f: [_Request(s, s.offset, s.nbytes, crc=s.crc32c) for s in segs]
            for f, segs in by_field.items()
            if not segs[0].ragged
        }
        ragged = {f: segs for f, segs in by_field.items() if segs[0].ragged}
        indexes = {f: [_Request(s, s.index, s.nbytes) for s in segs] for f, segs in ragged.items()}
        self._execute([r for rs in (*fixed.values(), *indexes.values()) for r in rs])
        values = {f: [_values_request(r) for r in rs] for f, rs in indexes.items()}
        self._execute([r for rs in values.values() for r in rs])
        out: dict[str, np.ndarray | RaggedRows] = {}
        for f, requests in fixed.items():
            s = requests[0].segment
            arrays = [r.array().view(s.dtype).reshape(r.segment.rows, *s.shape) for r in requests]
            out[f] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        for f, requests in values.items():
            dtype = requests[0].segment.dtype
            out[f] = RaggedRows(
                _concat([r.array().view(dtype) for r in requests], dtype),
                _concat([np.diff(r.index) for r in requests], np.int64),
            )
        return out

    def read_into(self, segments: Sequence[PayloadSegment], out: Any) -> None:
        """Fill ``out`` (a writable C-contiguous numpy array or CPU tensor) with the rows of
        ``segments`` (one fixed-width field) in order, straight from the file; no extra copy."""
        self.read_many([(segments, out)])

    def read_many(self, jobs: Iterable[ReadJob]) -> None:
        """:meth:`read_into` for many buffers at once: every file opened once, files in parallel."""
        requests = [r for segments, out in jobs for r in _into_requests(segments, out)]
        self._execute(requests)

    def _execute(self, requests: list[_Request]) -> None:
        by_file: dict[str, list[_Request]] = {}
        for r in requests:
            if r.nbytes == 0:
                r.dest = memoryview(b"") if r.dest is None else r.dest
                _check_crc(r, r.segment.file)
                continue
            by_file.setdefault(self.root.relative(r.segment.file), []).append(r)
        groups = list(by_file.items())
        fill_rows(lambda i: self._read_file(*groups[i]), len(groups), self.workers)

    def _read_file(self, file: str, requests: list[_Request]) -> None:
        path = self.root.full(file)
        handle: PayloadFile | None = None
        try:
            for r in sorted(requests, key=lambda r: r.offset):
                handle = self._read_request(path, handle, r)
                _check_crc(r, self._url(path))
        finally:
            if handle is not None:
                handle.close()

    def _open(self, path: str) -> PayloadFile:
        return self.root.open_read(path)

    def _read_request(self, path: str, handle: PayloadFile | None, r: _Request) -> PayloadFile:
        """Read ``r`` completely, reopening and backing off on a short read or I/O error."""
        got, size, failure, delay = 0, None, None, self.backoff
        for attempt in range(1, self.retries + 2):
            failure = None
            try:
                if handle is None:
                    handle = self._open(path)
                size = handle.size
                if r.dest is None and r.offset + r.nbytes <= size:
                    r.allocate()
                if r.dest is not None:
                    got = _fill(handle, r, got)
                if got == r.nbytes:
                    return handle
            except PermissionError as exc:
                raise PayloadPermissionError(
                    f"payload file {self._url(path)} may not be read: {exc}"
                ) from exc
            except OSError as exc:
                failure = exc
            if handle is not None:
                handle.close()
                handle = None
            if attempt <= self.retries:
                time.sleep(delay)
                delay = min(2 * delay, self.max_backoff)
        url, s = self._url(path), r.segment
        if isinstance(failure, FileNotFoundError):
            raise PayloadNotFoundError(
                f"payload file {url} does not exist (tried {attempt} times)"
            ) from failure
        if failure is not None:
            raise PayloadReadError(
                f"reading {url} at offset {r.offset} failed {attempt} times: {failure}"
            ) from failure
        raise PayloadReadError(
            f"short read of {url}: wanted {r.nbytes} bytes at offset {r.offset}, got {got} after "
            f"{attempt} attempts (file size {size}; field {s.field!r} rows [{s.pos}, {s.end}))"
        )

    def _url(self, path: str) -> str:
        return path if self.root.local_backed else self.root.fs.unstrip_protocol(path)


def _check_crc(r: _Request, url: str) -> None:
    if r.crc is None:
        return
    found = checksum(r.crc_tail, value=r.crc_running)
    if found != r.crc:
        s = r.segment
        raise PayloadChecksumError(
            f"checksum mismatch in {url}: field {s.field!r} rows [{s.pos}, {s.end}) at offset "
            f"{r.offset} ({r.nbytes} bytes): expected crc32c {r.crc:#010x}, found {found:#010x}"
        )


def _check_same_kind(
    field_segments: list[PayloadSegment], s: PayloadSegment
) -> list[PayloadSegment]:
    if field_segments:
        first = field_segments[0]
        if (first.dtype, first.shape, first.ragged) != (s.dtype, s.shape, s.ragged):
            raise SegmentError(
                f"segments of field {s.field!r} disagree: {first.dtype} {first.shape} "
                f"{'ragged' if first.ragged else 'fixed'} then {s.dtype} {s.shape} "
                f"{'ragged' if s.ragged else 'fixed'} (file {s.file})"
            )
    return field_segments


@dataclass(eq=False)
class _ValuesRequest(_Request):
    index: np.ndarray | None = None


def _values_request(index_request: _Request) -> _ValuesRequest:
    """The values a ragged segment's index table (already read) points at, checked first."""
    s = index_request.segment
    index = index_request.array().view(INDEX_DTYPE)
    steps = np.diff(index)
    if index[0] < 0 or (steps.size and steps.min() < 0):
        raise PayloadFormatError(
            f"{s.file}: ragged index of field {s.field!r} at byte {s.index} must be non-decreasing "
            f"from >= 0, found {index[: min(8, index.size)].tolist()}..."
        )
    first, last = int(index[0]), int(index[-1])
    return _ValuesRequest(
        s,
        s.offset + first * s.itemsize,
        (last - first) * s.itemsize,
        crc=s.crc32c,
        crc_tail=bytes(index_request.dest),
        index=index,
    )


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays).astype(dtype, copy=False)


def _into_requests(segments: Sequence[PayloadSegment], out: Any) -> list[_Request]:
    """Requests that fill ``out`` with the rows of ``segments``, after checking they fit exactly."""
    segments = list(segments)
    if not segments:
        raise SegmentError("read_into needs at least one segment")
    first = segments[0]
    for s in segments:
        _check_same_kind([first], s)
    if first.ragged:
        raise SegmentError(
            f"read_into fills fixed-width fields; {first.field!r} is ragged (use read())"
        )
    array = _host_view(out)
    rows = sum(s.rows for s in segments)
    per_row = int(np.prod(first.shape, dtype=np.int64))
    if (
        array.dtype != np.dtype(first.dtype)
        or array.ndim < 1
        or array.shape[0] != rows
        or int(np.prod(array.shape[1:], dtype=np.int64)) != per_row
    ):
        raise SegmentError(
            f"read_into: segments of field {first.field!r} hold {rows} rows of {first.dtype} "
            f"{first.shape}; out is {array.dtype} {array.shape}"
        )
    view = memoryview(array.reshape(-1).view(np.uint8))
    requests, cursor = [], 0
    for s in segments:
        requests.append(_Request(s, s.offset, s.nbytes, view[cursor : cursor + s.nbytes], s.crc32c))
        cursor += s.nbytes
    return requests


def _host_view(out: Any) -> np.ndarray:
    """A numpy view sharing ``out``'s memory; refuses what cannot be filled in place."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise SegmentError(f"read_into needs a CPU buffer, found a tensor on {out.device}")
        if not out.is_contiguous():
            raise SegmentError(f"read_into needs a contiguous tensor, found strides {out.stride()}")
        try:
            out = out.detach().numpy()
        except TypeError as exc:
            raise SegmentError(f"read_into cannot fill a {out.dtype} tensor: {exc}") from None
    if not isinstance(out, np.ndarray):
        raise SegmentError(
            f"read_into needs a numpy array or CPU tensor, found {type(out).__name__}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise SegmentError(
            f"read_into needs a writable C-contiguous buffer, found contiguous="
            f"{out.flags.c_contiguous} writeable={out.flags.writeable}"
        )
    return out
