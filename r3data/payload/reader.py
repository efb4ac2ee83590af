"""``PayloadReader``: byte ranges named by segments, read straight into caller buffers or arrays.

A batch's reads are one plan (:meth:`PayloadReader.read_ranges`): ranges are grouped by file,
each file is opened once, and ranges that are adjacent in the file are read together, one
``os.preadv`` per chunk on a local-backed filesystem (the file's bytes land in every
destination in one system call), ``readinto`` on any other fsspec filesystem. Each chunk is
checksummed and handed to the caller's ``on_bytes`` while it is still in cache. Files are read
concurrently on the shared pool. A read that comes up short (a file not yet fully visible on a
network filesystem, a flaky backend) closes the file, reopens it and resumes, with doubling
backoff, before giving up; every file is closed exactly once. Files are opened through
:meth:`PayloadRoot.open_name` (each handle normalised once per plan; a plan's first opens
beneath one root descriptor, :meth:`PayloadRoot.held`), confined to the root on every
filesystem class.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

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
from r3data.parallel import fill_rows, io_workers, pool_workers
from r3data.payload.fileformat import HEADER_READ_BYTES, checksum, read_header
from r3data.payload.fs import DEFAULT_TIMEOUT_S, PayloadFile, PayloadRoot
from r3data.ragged import RaggedRows
from r3data.validate import checked_int
from r3data.wire.segment import INDEX_DTYPE, PayloadSegment

__all__ = [
    "CHUNK_BYTES",
    "OpenFiles",
    "PayloadReader",
    "Plan",
    "PlanStop",
    "RangeRead",
    "ReadJob",
]

ReadJob = tuple[Sequence[PayloadSegment], Any]
"""Segments of one fixed-width field and the buffer (numpy array or CPU tensor) their rows fill."""

CHUNK_BYTES = 1 << 20
"""Bytes per read call: each chunk is checksummed and screened before it leaves the cache."""

_IOV_MAX = min(getattr(os, "IOV_MAX", 1024), 1024)
_KEEP_OPEN = 256
T = TypeVar("T")


@dataclass(eq=False, slots=True)
class RangeRead:
    """``nbytes`` at ``offset`` of ``segment.file`` into ``dest`` (a writable byte memoryview;
    allocated once the file proved large enough when None). ``crc``, when given, is checked
    over ``dest`` followed by ``crc_tail``. ``on_bytes(done)`` is told, after each chunk, how
    many leading bytes of ``dest`` are in place and checked so far."""

    segment: PayloadSegment
    offset: int
    nbytes: int
    dest: memoryview | None = None
    crc: int | None = None
    crc_tail: bytes = b""
    on_bytes: Callable[[int], None] | None = None
    crc_running: int = 0
    done: int = 0

    def array(self) -> np.ndarray:
        return np.frombuffer(self.dest, np.uint8)


def _runs(ranges: list[RangeRead]) -> list[list[RangeRead]]:
    """Ranges (in offset order) cut into runs that are contiguous in the file."""
    runs: list[list[RangeRead]] = []
    end = -1
    for r in ranges:
        if r.offset == end and len(runs[-1]) < _IOV_MAX:
            runs[-1].append(r)
        else:
            runs.append([r])
        end = r.offset + r.nbytes
    return runs


def _views(
    run: list[RangeRead], start: int, want: int
) -> tuple[list[tuple[RangeRead, int, int]], list[memoryview]]:
    """``(range, lo, hi)`` of the destination slices holding run bytes ``[start, start +
    want)``, and the slices."""
    if len(run) == 1:
        r = run[0]
        return [(r, start, start + want)], [r.dest[start : start + want]]
    pieces = []
    at = 0
    for r in run:
        lo, hi = max(start - at, 0), min(start + want - at, r.nbytes)
        if lo < hi:
            pieces.append((r, lo, hi))
        at += r.nbytes
        if at >= start + want:
            break
    return pieces, [r.dest[lo:hi] for r, lo, hi in pieces]


def _read_views(handle: PayloadFile, offset: int, views: list[memoryview]) -> int:
    """Fill ``views`` from ``offset`` on through ``handle.read_at`` (a file without a
    descriptor), up to the end of the file; returns the bytes read."""
    got = 0
    for view in views:
        n = handle.read_at(offset + got, view)
        got += n
        if n < len(view):
            break
    return got


def _landed(pieces: list[tuple[RangeRead, int, int]], views: list[memoryview], got: int) -> None:
    """Account ``got`` bytes of a chunk (``views`` of ``pieces``): checksums and ``on_bytes`` of
    every range touched."""
    for (r, lo, hi), view in zip(pieces, views, strict=True):
        n = min(hi - lo, got)
        if n <= 0:
            break
        if r.crc is not None:
            r.crc_running = checksum(view if n == hi - lo else view[:n], value=r.crc_running)
        r.done = lo + n
        if r.on_bytes is not None:
            try:
                r.on_bytes(r.done)
            except Exception as exc:
                exc.r3data_range = r  # type: ignore[attr-defined]  # not the run's next range
                raise
        got -= n


class OpenFiles:
    """Files opened to check their sizes, kept open for the reads of the same plan (at most
    ``budget`` of them: a batch may name thousands of files). Whatever no read took is closed
    by :meth:`close`. ``names`` holds the root-relative name of each handle checked, so the
    plan's reads normalise no handle twice (a name is a function of the handle and the root: an
    ``OpenFiles`` serves one reader)."""

    def __init__(self, budget: int | None = None) -> None:
        if budget is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            budget = _KEEP_OPEN if soft == resource.RLIM_INFINITY else min(_KEEP_OPEN, soft // 4)
        self.budget = budget
        self.names: dict[str, str] = {}
        self._handles: dict[str, PayloadFile] = {}
        self._lock = threading.Lock()

    def put(self, name: str, handle: PayloadFile) -> bool:
        """Keep ``handle`` for ``name``; False (the caller closes it) when the budget is spent."""
        with self._lock:
            if len(self._handles) >= self.budget or name in self._handles:
                return False
            self._handles[name] = handle
            return True

    def take(self, name: str) -> PayloadFile | None:
        with self._lock:
            return self._handles.pop(name, None)

    def close(self) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.close()


class _Stopped(Exception):
    """A job its plan never started: the plan had stopped (what the plan raises is the first
    failure, or the caller's interrupt)."""


class PlanStop:
    """A stop for every :class:`Plan` made inside its :meth:`run` (a loader's batch
    being prepared, whatever plans its fill makes): :meth:`set`, from any thread, sets the
    :attr:`Plan.stop` of those under way and of any started later, so each stops at its next
    call to the filesystem."""

    def __init__(self) -> None:
        # reentrant: a collection inside it may run a dropped loader's finalizer, which sets it
        self._lock = threading.RLock()
        self._plans: set[Plan] = set()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            plans = list(self._plans)
        for plan in plans:
            plan.stop.set()

    def run(self, call: Callable[[], T]) -> T:
        """``call()``, whose plans answer to this stop. It runs in a copy of the thread's
        context, so the stop never outlives the call, whatever interrupt lands where (a
        ``finally`` resetting a variable is itself a line an interrupt can skip)."""
        return contextvars.copy_context().run(self._run_within, call)

    def _run_within(self, call: Callable[[], T]) -> T:
        _PLAN_STOP.set(self)
        return call()

    @contextlib.contextmanager
    def _covering(self, plan: Plan) -> Iterator[None]:
        with self._lock:
            self._plans.add(plan)
            if self._set:
                plan.stop.set()
        try:
            yield
        finally:
            with self._lock:
                self._plans.discard(plan)


_PLAN_STOP: contextvars.ContextVar[PlanStop | None] = contextvars.ContextVar(
    "r3data_plan_stop", default=None
)


class Plan:
    """One plan's jobs on the pool (a batch's reads, a fill's reads and copies), for a caller
    that may be interrupted while they run (a ``KeyboardInterrupt``, a loader shutting down:
    the :class:`PlanStop` it runs within) and whose jobs may fail: either sets :attr:`stop`,
    which every job of the plan is to check at its next call to the filesystem
    (:meth:`PayloadReader.file_jobs`), so none retries on; :meth:`run` then waits for the calls
    under way (each bounded by the root's timeout), starts no other job, and raises the job's
    failure that stopped it, the interrupt, or (stopped from outside) a
    :class:`PayloadReadError`: no job outlives the call, nor the root descriptor or buffer it
    shares."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._running = 0
        self._idle = threading.Condition()
        self._failure: BaseException | None = None

    def run(self, job: Callable[[int], None], n: int, workers: int) -> None:
        """Run ``job(i)`` for ``i in range(n)``, at most ``workers`` at once
        (:func:`~r3data.parallel.fill_rows`)."""
        outer = _PLAN_STOP.get()
        with contextlib.nullcontext() if outer is None else outer._covering(self):
            self._run(job, n, workers)

    def _run(self, job: Callable[[int], None], n: int, workers: int) -> None:
        caller = threading.get_ident()

        def counted(i: int) -> None:
            # Only jobs on other threads are counted: one run inline on the caller's thread
            # is over once an interrupt reaches the caller, and a count an interrupt could
            # land in the middle of would leave the wait below waiting forever.
            counts = threading.get_ident() != caller
            with self._idle:
                if self.stop.is_set():
                    raise _Stopped
                if counts:
                    self._running += 1
            try:
                job(i)
            except BaseException as exc:
                with self._idle:
                    if not self.stop.is_set():  # the first failure; any later one its echo
                        self._failure = exc
                        self.stop.set()
                raise
            finally:
                if counts:
                    with self._idle:
                        self._running -= 1
                        self._idle.notify_all()

        try:
            fill_rows(counted, n, workers)
            return
        except BaseException as exc:
            self.stop.set()  # lanes still running when the caller itself was interrupted
            with self._idle:
                self._idle.wait_for(lambda: self._running == 0)
            first = self._failure
            if first is None and isinstance(exc, _Stopped):  # stopped from outside
                raise PayloadReadError("reads stopped: their caller was shut down") from None
            if first is None or first is exc or not isinstance(exc, Exception):
                raise
        raise first  # fill_rows raises the first lane's failure, maybe one stopped for it


class PayloadReader:
    """Reads segments' rows from files under ``root`` (a path or fsspec URL; or a path in ``fs``).

    ``workers`` bounds the files read at once (default: the CPUs this process may use on a
    local-backed root, where a read is a copy from the page cache; more on other filesystems,
    where reads wait on the network). A short read or I/O error is retried ``retries`` times,
    reopening the file, after ``backoff`` seconds doubling up to ``max_backoff``. Segments
    carrying ``crc32c`` are verified.

    ``timeout`` (seconds; :data:`~r3data.payload.deadline.DEFAULT_TIMEOUT_S`; None: no limit) bounds
    each call to a root that is not local-backed (an open's look-up, each ranged read of at
    most :data:`CHUNK_BYTES`): a call past it is an I/O error like any other, retried as above,
    so a store that stops answering fails a read with :class:`PayloadReadError` after at most
    ``(retries + 1) * timeout`` seconds plus the backoff, per file. A plan interrupted in its
    caller (``KeyboardInterrupt``, a loader shutting down), or one of whose files failed for
    good, stops its other files' reads at their next call (or backoff) instead of retrying on
    (:class:`Plan`). ``follow_symlinks=False``: no symlink beneath the root is followed
    (:class:`~r3data.payload.fs.PayloadRoot`).
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
        timeout: float | None = DEFAULT_TIMEOUT_S,
        follow_symlinks: bool = True,
    ) -> None:
        self.root = PayloadRoot(root, fs, timeout=timeout, follow_symlinks=follow_symlinks)
        default = pool_workers() if self.root.local_backed else io_workers()
        self.workers = checked_int("workers", default if workers is None else workers, minimum=1)
        self.retries = checked_int("retries", retries)
        if not 0 <= backoff <= max_backoff:
            raise ConfigError(
                f"backoff must satisfy 0 <= backoff <= max_backoff, found {backoff} and {max_backoff}"
            )
        self.backoff = backoff
        self.max_backoff = max_backoff

    def __repr__(self) -> str:
        return (
            f"PayloadReader({self.root}, workers={self.workers}, retries={self.retries}, "
            f"timeout={self.timeout})"
        )

    @property
    def timeout(self) -> float | None:
        """Seconds one call to the filesystem may take (None: no limit)."""
        return self.root.timeout

    def files(self, segments: Iterable[PayloadSegment]) -> list[str]:
        """The files (relative to the root, normalised) that reading ``segments`` touches."""
        return sorted({self.root.relative(s.file) for s in segments})

    # --- the plan -----------------------------------------------------------------------------

    def read_ranges(self, ranges: Iterable[RangeRead]) -> None:
        """Read every range: files in parallel, each opened once, adjacent ranges together."""
        plan = Plan()
        with self.root.held() as root_fd:  # every file's first open: one root descriptor
            jobs = self.file_jobs(ranges, root_fd=root_fd, stop=plan.stop)
            plan.run(lambda i: jobs[i](), len(jobs), self.workers)

    def file_jobs(
        self,
        ranges: Iterable[RangeRead],
        opened: OpenFiles | None = None,
        root_fd: int | None = None,
        stop: threading.Event | None = None,
    ) -> list[Callable[[], None]]:
        """One job per file reading its ranges, for a caller that runs them on its own pool
        alongside other work (empty ranges are done at once); a file ``opened`` kept from
        :meth:`check_sizes` is read without opening it again, any other first opened beneath
        ``root_fd`` (:meth:`PayloadRoot.held`, held until every job has run); once ``stop`` is
        set, a job fails at its next call to the filesystem instead of retrying on."""
        by_file: dict[str, list[RangeRead]] = {}
        file_bytes: dict[str, int] = {}
        # handle -> root-relative name (ranges share files; the sizes check named them already)
        names: dict[str, str] = {} if opened is None else opened.names
        for r in ranges:
            nbytes = r.nbytes
            if nbytes == 0:
                r.dest = memoryview(b"") if r.dest is None else r.dest
                _check_crc(r, r.segment.file)
                continue
            file = r.segment.file
            name = names.get(file)
            if name is None:
                name = names[file] = self.root.relative(file)
            group = by_file.get(name)
            if group is None:
                by_file[name] = [r]
                file_bytes[name] = nbytes
            else:
                group.append(r)
                file_bytes[name] += nbytes
        # Largest first: lanes pulling the next job then finish together (a heavy tail of file
        # sizes otherwise leaves one lane reading the biggest file alone at the end).
        order = sorted(file_bytes, key=file_bytes.__getitem__, reverse=True)
        return [
            partial(self._read_file, name, by_file[name], opened, root_fd, stop) for name in order
        ]

    def check_sizes(
        self, segments: Iterable[PayloadSegment], keep: OpenFiles | None = None
    ) -> None:
        """Refuse, before anything is allocated for them, segments that claim bytes past the
        end of their file (:class:`SegmentError`); a file shorter than its claims is looked at
        again, with the read's backoff, in case it is still growing. Files checked are kept
        open in ``keep`` (up to its budget) for the reads that follow."""
        self._check_claims(
            ((s, (s.offset if s.index is None else s.index) + s.nbytes) for s in segments), keep
        )

    def check_ranges(self, ranges: Iterable[RangeRead], keep: OpenFiles | None = None) -> None:
        """:meth:`check_sizes` for ranges whose extent came from the file itself (the values a
        ragged segment's index table points at), before anything is allocated for them."""
        self._check_claims(((r.segment, r.offset + r.nbytes) for r in ranges), keep)

    def _check_claims(
        self, claimed: Iterable[tuple[PayloadSegment, int]], keep: OpenFiles | None
    ) -> None:
        """Check ``(segment, the byte its claim ends at)`` pairs against their files."""
        ends: dict[str, tuple[int, PayloadSegment]] = {}
        names: dict[str, str] = {} if keep is None else keep.names  # handle -> name
        for s, end in claimed:
            name = names.get(s.file)
            if name is None:
                try:
                    name = names[s.file] = self.root.relative(s.file)
                except Exception as exc:
                    exc.r3data_segment = s  # type: ignore[attr-defined]  # which claim failed
                    raise
            claim = ends.get(name)
            if claim is None or end > claim[0]:
                ends[name] = (end, s)
        claims = list(ends.items())
        workers = 1 if self.root.local_backed else self.workers  # an open is microseconds here
        plan = Plan()
        with self.root.held() as root_fd:  # the first look at every file: one root descriptor
            plan.run(
                partial(self._check_size, claims, keep, root_fd, plan.stop), len(claims), workers
            )

    def _check_size(
        self,
        claims: list[tuple[str, tuple[int, PayloadSegment]]],
        keep: OpenFiles | None,
        root_fd: int | None,
        stop: threading.Event,
        i: int,
    ) -> None:
        """Check claim ``i``: the furthest byte any segment claims of one file, first looked at
        beneath ``root_fd`` (:meth:`PayloadRoot.held`); any other look finds the root afresh."""
        name, (end, s) = claims[i]
        try:
            delay = self.backoff
            for attempt in range(1, self.retries + 2):
                handle = self._open_retrying(name, s, root_fd if attempt == 1 else None, stop)
                size, url = handle.size, handle.url
                if end <= size and keep is not None and keep.put(name, handle):
                    return
                handle.close()
                if end <= size:
                    return
                if attempt <= self.retries:
                    _pause(delay, stop)
                    delay = min(2 * delay, self.max_backoff)
            raise SegmentError(
                f"{url}: segment of field {s.field!r} rows [{s.pos}, {s.end}) claims bytes up "
                f"to {end}, but the file has {size} bytes (looked {attempt} times)"
            )
        except Exception as exc:
            exc.r3data_segment = s  # type: ignore[attr-defined]  # which claim failed
            raise

    # --- reading files --------------------------------------------------------------------------

    def _open_retrying(
        self,
        name: str,
        s: PayloadSegment,
        root_fd: int | None = None,
        stop: threading.Event | None = None,
    ) -> Any:
        """Open ``name`` (first beneath ``root_fd``, if given; any other attempt finds the root
        by its path); a missing file or an I/O error is retried like a short read."""
        delay, failure = self.backoff, None
        for attempt in range(1, self.retries + 2):
            self._check_stop(name, stop)
            try:
                return self.root.open_name(name, root_fd=root_fd if attempt == 1 else None)
            except PermissionError as exc:
                raise self._denied(name, exc) from exc
            except OSError as exc:
                failure = exc
            if attempt <= self.retries:
                _pause(delay, stop)
                delay = min(2 * delay, self.max_backoff)
        raise self._failed(name, s.offset, failure, attempt)

    def _read_file(
        self,
        name: str,
        ranges: list[RangeRead],
        opened: OpenFiles | None,
        root_fd: int | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Read ``ranges`` of one file (the one kept ``opened``, if any, else first opened
        beneath ``root_fd``); a failure carries the range it happened in
        (``exc.r3data_range``), so a caller can name what needed it."""
        handle = None if opened is None else opened.take(name)
        run = ranges
        try:
            several = len(ranges) > 1
            if several:
                ranges.sort(key=_offset)
            for run in _runs(ranges) if several else (ranges,):
                handle = self._read_run(name, handle, run, root_fd, stop)
        except Exception as exc:
            if getattr(exc, "r3data_range", None) is None:  # a short read: the range it cut
                exc.r3data_range = next((r for r in run if r.done < r.nbytes), run[0])  # type: ignore[attr-defined]
            raise
        finally:
            if handle is not None:
                handle.close()

    def _read_run(
        self,
        name: str,
        handle: PayloadFile | None,
        run: list[RangeRead],
        root_fd: int | None,
        stop: threading.Event | None = None,
    ) -> Any:
        """Read one run completely, reopening and backing off on a short read or I/O error
        (``handle`` when given, else first opened beneath ``root_fd``, if given; every reopen
        finds the root by its path). Returns the open file (the caller closes it); on any
        failure it is already closed (a close is idempotent: a descriptor is closed exactly
        once)."""
        one = len(run) == 1
        total = run[0].nbytes if one else sum(r.nbytes for r in run)
        done, size, failure, delay = 0, None, None, self.backoff
        try:
            for attempt in range(1, self.retries + 2):
                failure = None
                self._check_stop(name, stop)
                try:
                    if handle is None:
                        handle = self.root.open_name(
                            name, root_fd=root_fd if attempt == 1 else None
                        )
                    size = handle.size
                    if attempt == 1 and one and _read_whole(handle, run[0]):
                        done = total
                    else:
                        done = _fill_run(handle, run, done, size, total, stop)
                except PermissionError as exc:
                    raise self._denied(name, exc) from exc
                except OSError as exc:
                    failure = exc
                if done == total and failure is None:
                    for r in run:  # a mismatch is the bytes themselves: not retried
                        if r.crc is not None:
                            _check_crc(r, handle.url, handle, stop)
                    return handle
                handle = _closed(handle)
                if attempt <= self.retries:
                    _pause(delay, stop)
                    delay = min(2 * delay, self.max_backoff)
        except BaseException:
            _closed(handle)
            raise
        if failure is not None:
            raise self._failed(name, run[0].offset, failure, attempt)
        short = next(r for r in run if r.done < r.nbytes)
        s = short.segment
        raise PayloadReadError(
            f"short read of {self._url(name)}: wanted {short.nbytes} bytes at offset "
            f"{short.offset}, got {short.done} after {attempt} attempts (file size {size}; "
            f"field {s.field!r} rows [{s.pos}, {s.end}))"
        )

    def _url(self, name: str) -> str:
        return self.root.url_of(name)

    def _check_stop(self, name: str, stop: threading.Event | None) -> None:
        if stop is not None and stop.is_set():
            raise PayloadReadError(
                f"reading {self._url(name)}: stopped (another read of its plan failed, or its "
                f"caller was interrupted or shut down)"
            )

    def _denied(self, name: str, exc: OSError) -> PayloadPermissionError:
        if isinstance(exc, PayloadPermissionError):
            return exc
        return PayloadPermissionError(f"payload file {self._url(name)} may not be read: {exc}")

    def _failed(
        self, name: str, offset: int, failure: OSError | None, attempt: int
    ) -> PayloadReadError:
        url = self._url(name)
        if isinstance(failure, FileNotFoundError):
            return PayloadNotFoundError(
                f"payload file {url} does not exist (tried {attempt} times)"
            )
        return PayloadReadError(
            f"reading {url} at offset {offset} failed {attempt} times: {failure}"
        )

    # --- convenience entry points ------------------------------------------------------------

    def read(self, segments: Iterable[PayloadSegment]) -> dict[str, np.ndarray | RaggedRows]:
        """Rows of every field, segments of a field concatenated in the order given.

        A fixed-width field comes back as ``[rows, *shape]``; a ragged one as
        :class:`~r3data.ragged.RaggedRows`. Each segment is allocated after its file proved
        large enough; for one copy into a batch buffer use :meth:`read_into`.
        """
        by_field: dict[str, list[PayloadSegment]] = {}
        for s in segments:
            _check_same_kind(by_field.setdefault(s.field, []), s).append(s)
        fixed = {
            f: [RangeRead(s, s.offset, s.nbytes, crc=s.crc32c) for s in segs]
            for f, segs in by_field.items()
            if not segs[0].ragged
        }
        ragged = {f: segs for f, segs in by_field.items() if segs[0].ragged}
        indexes = {f: [RangeRead(s, s.index, s.nbytes) for s in segs] for f, segs in ragged.items()}
        self.read_ranges([r for rs in (*fixed.values(), *indexes.values()) for r in rs])
        values = {f: [values_range(r) for r in rs] for f, rs in indexes.items()}
        self.read_ranges([v for vs in values.values() for v, _ in vs])
        out: dict[str, np.ndarray | RaggedRows] = {}
        for f, requests in fixed.items():
            s = requests[0].segment
            arrays = [r.array().view(s.dtype).reshape(r.segment.rows, *s.shape) for r in requests]
            out[f] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        for f, parts in values.items():
            dtype = parts[0][0].segment.dtype
            out[f] = RaggedRows.from_lengths(
                _concat([v.array().view(dtype) for v, _ in parts], dtype),
                _concat([np.diff(index) for _, index in parts], np.int64),
            )
        return out

    def read_into(self, segments: Sequence[PayloadSegment], out: Any) -> None:
        """Fill ``out`` (a writable C-contiguous numpy array or CPU tensor) with the rows of
        ``segments`` (one fixed-width field) in order, straight from the file; no extra copy."""
        self.read_many([(segments, out)])

    def read_many(self, jobs: Iterable[ReadJob]) -> None:
        """:meth:`read_into` for many buffers at once: every file opened once, files in parallel."""
        self.read_ranges([r for segments, out in jobs for r in _into_ranges(segments, out)])


def _fill_run(
    handle: PayloadFile,
    run: list[RangeRead],
    done: int,
    size: int,
    total: int,
    stop: threading.Event | None = None,
) -> int:
    """Read the run (``total`` bytes) from its byte ``done`` on until it is complete, the file
    ends or ``stop`` is set; returns the bytes in place."""
    for r in run if done == 0 else ():
        if r.dest is None:  # destinations to allocate, once the file proved large enough
            if run[-1].offset + run[-1].nbytes > size:
                return 0
            for unallocated in run:
                if unallocated.dest is None:
                    unallocated.dest = memoryview(np.empty(unallocated.nbytes, np.uint8))
            break
    start, fd = run[0].offset, handle.fd
    while done < total and (stop is None or not stop.is_set()):
        pieces, views = _views(
            run, done, CHUNK_BYTES if total - done > CHUNK_BYTES else total - done
        )
        if fd is not None:
            got = os.preadv(fd, views, start + done)
        else:
            got = _read_views(handle, start + done, views)
        if got <= 0:
            break
        _landed(pieces, views, got)
        done += got
    return done


def _read_whole(handle: PayloadFile, r: RangeRead) -> bool:
    """The common case in few calls: ``r``, one chunk at most filling its own destination
    (one no screen watches), read whole from the descriptor ``handle`` holds and checksummed
    (the caller checks it); False, nothing accounted, when it does not fit that case or the
    read falls short or fails (the general path then reads it from the start, on the same
    attempt)."""
    fd, dest = handle.fd, r.dest
    if fd is None or dest is None or r.on_bytes is not None or r.nbytes > CHUNK_BYTES:
        return False
    if dest.nbytes != r.nbytes:  # the caller's bytes past the range: never written
        return False
    try:
        got = os.preadv(fd, [dest], r.offset)
    except OSError:
        return False
    if got != r.nbytes:
        return False
    if r.crc is not None:
        r.crc_running = checksum(dest)
    r.done = got
    return True


def _pause(delay: float, stop: threading.Event | None) -> None:
    """The backoff before a retry, cut short once ``stop`` is set (the retry then checks it)."""
    if stop is None:
        time.sleep(delay)
    else:
        stop.wait(delay)


def _offset(r: RangeRead) -> int:
    return r.offset


def _closed(handle: PayloadFile | None) -> None:
    """Close ``handle`` (once) and forget it."""
    if handle is not None:
        handle.close()


def _check_crc(
    r: RangeRead,
    url: str,
    handle: PayloadFile | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Refuse ``r``'s bytes unless they match its checksum, or (read from ``handle``) are a
    part of a field of the file that checks whole (:func:`_part_of_checked_field`)."""
    if r.crc is None:
        return
    found = checksum(r.crc_tail, value=r.crc_running) if r.crc_tail else r.crc_running
    if found != r.crc and (handle is None or not _part_of_checked_field(handle, r, stop)):
        s = r.segment
        whole = "" if handle is None or s.ragged else "; nor a clipped part of a field that checks"
        error = PayloadChecksumError(
            f"checksum mismatch in {url}: field {s.field!r} rows [{s.pos}, {s.end}) at offset "
            f"{r.offset} ({r.nbytes} bytes): expected crc32c {r.crc:#010x}, found "
            f"{found:#010x}{whole}"
        )
        error.r3data_range = r  # type: ignore[attr-defined]  # the range, not its run's first
        raise error


def _part_of_checked_field(
    handle: PayloadFile, r: RangeRead, stop: threading.Event | None = None
) -> bool:
    """Whether ``r``, read for a fixed-width segment whose checksum its bytes do not match, is
    the same rows of a field of its file: the segment's ``crc32c``, dtype and row shape, its
    rows at the positions the file's table gives them, and the field's bytes, read again
    whole, matching that checksum and ``r``'s bytes. A router merging prefill and decode rows
    (PrimeIntellect-ai/router ``merge_routed_payload_in_json``) clips a decode segment by
    moving its ``offset``, ``pos`` and ``rows`` and keeps its ``crc32c``, which covers the
    field as written. Only a mismatch pays for this: the header, and the field read again in
    chunks of :data:`CHUNK_BYTES` (each read under the root's timeout; ``stop`` ends it)."""
    s = r.segment
    if s.ragged or r.crc_tail or r.dest is None or r.nbytes == 0:
        return False
    try:
        fields = read_header(handle.stream(HEADER_READ_BYTES), handle.url).fields
    except PayloadFormatError:  # no payload header (a raw file), or none that parses
        return False
    for entry in fields:
        e = entry.segment
        same_kind = (e.field, e.crc32c, e.dtype, e.shape) == (s.field, r.crc, s.dtype, s.shape)
        skip = r.offset - e.offset
        if not same_kind or e.ragged or not e.rows or skip < 0:
            continue
        row_bytes = entry.nbytes // e.rows
        if skip % row_bytes or s.pos - e.pos != skip // row_bytes:
            continue
        if r.offset + r.nbytes > e.offset + entry.nbytes:
            continue
        return _field_checks_and_holds(handle, e.offset, entry.nbytes, r, stop)
    return False


def _field_checks_and_holds(
    handle: PayloadFile, start: int, nbytes: int, r: RangeRead, stop: threading.Event | None
) -> bool:
    """Whether the field at ``[start, start + nbytes)`` matches ``r.crc`` and holds ``r``'s
    bytes where ``r`` read them."""
    landed = np.frombuffer(r.dest, np.uint8, r.nbytes)
    chunk = np.empty(min(CHUNK_BYTES, nbytes), np.uint8)
    crc, at = 0, start
    while at < start + nbytes:
        if stop is not None and stop.is_set():
            raise PayloadReadError(f"reading {handle.url}: stopped (its plan was stopped)")
        view = memoryview(chunk)[: min(CHUNK_BYTES, start + nbytes - at)]
        got = handle.read_at(at, view)
        if got <= 0:
            return False
        part = chunk[:got]
        crc = checksum(part, value=crc)
        lo, hi = max(at, r.offset), min(at + got, r.offset + r.nbytes)
        if lo < hi and not np.array_equal(
            part[lo - at : hi - at], landed[lo - r.offset : hi - r.offset]
        ):
            return False
        at += got
    return crc == r.crc


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


def ragged_index(index_range: RangeRead) -> np.ndarray:
    """The element offsets a ragged segment's index table (already read) holds, checked."""
    s = index_range.segment
    index = index_range.array().view(INDEX_DTYPE)
    # compared, not differenced: a difference wraps around int64 and hides a fall
    if index[0] < 0 or (index[1:] < index[:-1]).any():
        raise PayloadFormatError(
            f"{s.file}: ragged index of field {s.field!r} at byte {s.index} must be non-decreasing "
            f"from >= 0, found {index[: min(8, index.size)].tolist()}..."
        )
    return index


def values_range(
    index_range: RangeRead, dest: memoryview | None = None
) -> tuple[RangeRead, np.ndarray]:
    """The range of values a ragged segment's index table (already read) points at, and the
    index; the segment's checksum covers the values, then the index table."""
    s = index_range.segment
    index = ragged_index(index_range)
    first, last = int(index[0]), int(index[-1])
    values = RangeRead(
        s,
        s.offset + first * s.itemsize,
        (last - first) * s.itemsize,
        dest,
        crc=s.crc32c,
        crc_tail=bytes(index_range.dest),
    )
    return values, index


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays).astype(dtype, copy=False)


def _into_ranges(segments: Sequence[PayloadSegment], out: Any) -> list[RangeRead]:
    """Ranges that fill ``out`` with the rows of ``segments``, after checking they fit exactly."""
    segments = list(segments)
    if not segments:
        raise SegmentError("read_into needs at least one segment")
    first = segments[0]
    kind = (first.dtype, first.shape, first.ragged)
    for s in segments:
        if (s.dtype, s.shape, s.ragged) != kind:
            _check_same_kind([first], s)
    if first.ragged:
        raise SegmentError(
            f"read_into fills fixed-width fields; {first.field!r} is ragged (use read())"
        )
    array = host_view(out)
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
    row_bytes = first.row_bytes  # the same for every segment: same dtype and shape
    ranges, cursor = [], 0
    for s in segments:
        end = cursor + s.rows * row_bytes
        ranges.append(RangeRead(s, s.offset, end - cursor, view[cursor:end], s.crc32c))
        cursor = end
    return ranges


def host_view(out: Any) -> np.ndarray:
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
