"""Retention of payload files: delete on consume, a version backstop, and ``gc`` for the CLI.

A file may be deleted once the trainer has finished the step whose batch read it. Files nobody
claims (cancelled rollouts, files from before a resume) are removed by the backstop once their
policy version is too old for any future batch: with at most ``M`` off-policy steps, a batch for
step ``s`` uses versions ``>= s - M``.

Several ranks on one root (``group=``, a ``torch.distributed`` process group of every rank
that reads the root): each rank claims what its own batches read; ``on_policy_update(step)``
is then a collective: every rank sends its claims and discards since the last update to rank
0 of the group, the only one that deletes, which releases ``step`` only once every rank has
called it, that is, has finished reading every batch of that step. A claim a rank makes after
the update of a step cannot protect a file released by it: a map-style loader claims every
file for its last step up front, so only a stream whose samples share a file across steps
relies on the backstop.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from fsspec import AbstractFileSystem

from r3data.errors import (
    ConfigError,
    PayloadHandleError,
    PayloadPermissionError,
    PayloadReadError,
    PayloadWriteError,
)
from r3data.parallel import shared_pool
from r3data.payload.fs import DEFAULT_TIMEOUT_S, PayloadRoot
from r3data.validate import checked_int

__all__ = [
    "GcReport",
    "PayloadRetention",
    "RetentionMetrics",
    "gc",
    "list_versions",
    "min_fresh_version",
]

logger = logging.getLogger(__name__)

VERSION_DIR = re.compile(r"v(\d+)")

CLOCK_MARGIN_S = 2.0
"""A fresh run keeps files modified less than this before it started: object stores keep
modification times to the second, and a shared filesystem's clock may drift a little from the
trainer's. What it keeps, the backstop removes later."""


def min_fresh_version(step: int, max_off_policy_steps: int) -> int:
    """The oldest policy version a batch for ``step`` may use: ``max(0, step - M)``."""
    step = checked_int("step", step)
    return max(0, step - checked_int("max_off_policy_steps", max_off_policy_steps))


def list_versions(root: PayloadRoot) -> dict[int, list[tuple[str, int]]]:
    """Every ``v<k>`` directory under ``root``: version -> [(root-relative file, size in bytes)]."""
    root.fs.invalidate_cache(root.path)  # other processes write and delete: trust no cached listing
    try:
        entries = root.call("ls", root.path, detail=True)
    except FileNotFoundError:
        return {}
    versions: dict[int, list[tuple[str, int]]] = {}
    for entry in entries:
        match = VERSION_DIR.fullmatch(posixpath.basename(entry["name"].rstrip("/")))
        if entry["type"] != "directory" or match is None:
            continue
        listed = root.call("ls", entry["name"], detail=True)
        versions[int(match.group(1))] = root.files(f for f in listed if f["type"] == "file")
    return versions


def _remove_dir(root: PayloadRoot, version: int) -> None:
    """Remove an emptied version directory (object stores have none; a busy one stays)."""
    path = posixpath.join(root.path, f"v{version}")
    try:
        if root.call("isdir", path) and not root.call("ls", path):
            root.call("rmdir", path)
    except OSError as exc:
        logger.debug("keeping %s: %s", path, exc)


def _process_started() -> float:
    """When this process started, in seconds since the epoch (Linux's ``/proc``)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start after boot
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _wipe_before(root: PayloadRoot, started: float) -> None:
    """Delete the files of every ``v<k>`` last modified before ``started`` (a fresh run)."""
    denied, failed = [], []
    versions = list_versions(root)
    due, tried = sum(len(files) for files in versions.values()), 0
    for version, files in versions.items():
        for name, _ in files:
            tried += 1
            try:
                modified = root.call("modified", posixpath.join(root.path, name)).timestamp()
                if modified < started - CLOCK_MARGIN_S:
                    root.remove(name)
            except FileNotFoundError:
                continue
            except PermissionError as exc:
                denied.append(f"{name} ({exc})")
            except PayloadReadError as exc:  # no answer in time: every other file would wait
                raise PayloadWriteError(
                    f"fresh run: the payload files of an earlier run under {root.url} could not "
                    f"be deleted, stopped after {tried} of {due} files: {exc}"
                ) from exc
            except (OSError, PayloadHandleError) as exc:  # a folder swapped for a link
                failed.append(f"{name} ({exc})")
        _remove_dir(root, version)
    if denied:
        raise PayloadPermissionError(
            f"fresh run: {len(denied)} payload files of an earlier run under {root.url} may not "
            f"be deleted, e.g. {denied[0]}"
        )
    if failed:
        raise PayloadWriteError(
            f"fresh run: {len(failed)} payload files of an earlier run under {root.url} could "
            f"not be deleted, e.g. {failed[0]}"
        )


@dataclass(frozen=True)
class RetentionMetrics:
    """Counters of a :class:`PayloadRetention`; ``*_live`` as of the last sweep of the root."""

    files_claimed: int
    files_pending: int
    files_live: int
    bytes_live: int
    files_deleted: int
    bytes_deleted: int
    delete_errors: int
    deletion_latency_s_last: float
    deletion_latency_s_mean: float
    deletion_latency_s_max: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Latency:
    """Running last/mean/max of deletion latencies, in constant memory."""

    def __init__(self) -> None:
        self.count, self.total, self.max, self.last = 0, 0.0, 0.0, 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)
        self.last = seconds

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


class PayloadRetention:
    """Deletes payload files once the batches that read them are trained on.

    Nothing is deleted before it was consumed:

    - ``claim(step, files)`` when the batch for ``step`` ships. A file is kept until
      ``on_policy_update(s)`` with ``s`` at least the *latest* step that claimed it (a file
      shared by a GRPO group split across batches stays for the last of them).
    - ``discard(files)`` for dropped samples. A discarded file is deleted at the next
      ``on_policy_update(s)`` unless a batch for a step ``> s`` claimed it by then (a later,
      prefetched batch may share the file); it then goes when that claim is released.
    - ``on_policy_update(step)`` after the optimizer step releases every claim ``<= step``,
      deletes those files and the due discarded ones, and sweeps versions older than
      ``min_fresh_version(step + 1, max_off_policy_steps)`` of unclaimed files.
    - ``claim(step, files, delete_on_release=False)`` (a stream's files: a sample not read
      yet may still name them) keeps them as long, then leaves them to the version sweep; so
      does the release of a file claimed both ways while either claim held.
    - A claim of a released or discarded file not yet deleted keeps it. A claim of a file whose
      deletion is under way waits for it to finish, so a file that exists when ``claim``
      returns stays until its step is released; one deleted before cannot come back (a read
      of it raises :class:`~r3data.errors.PayloadNotFoundError`): claim a batch's files before
      the update that releases them.

    Deletion runs on the shared pool and never blocks the caller; a failed deletion is logged
    and retried on the next call. ``timeout`` bounds each call to a root that is not
    local-backed (a listing, a deletion: :data:`~r3data.payload.deadline.DEFAULT_TIMEOUT_S`), so a
    store that stops answering fails a pass (logged, retried on the next call) instead of
    holding :meth:`wait`, :meth:`close` and a claim of a file being deleted for as long as
    the client's own retries take. A deletion past its deadline is in doubt (the store may
    still apply it): the file stays due and is deleted again on the next pass.

    ``fresh`` has no default, so that forgetting it cannot wipe a resumed run: ``fresh=True``
    (a new run) first deletes the files in ``v<k>`` directories that were last modified before
    ``run_started`` (seconds since the epoch; default: when this process started), so that what
    a writer of this run published before retention was set up stays; ``fresh=False`` (a
    resumed run) keeps everything and lets the backstop clear what the old run left. A file the
    wipe may not delete raises :class:`~r3data.errors.PayloadPermissionError`.

    ``group``: a ``torch.distributed`` process group of every rank that reads this root (e.g.
    ``torch.distributed.group.WORLD``; with NCCL, a gloo group made with ``new_group``). Every
    rank makes its own ``PayloadRetention`` and calls ``on_policy_update(step)`` after each
    optimizer step, a collective; rank 0 of the group deletes (and wipes a fresh run), once
    every rank has finished the step (see the module docstring).
    """

    def __init__(
        self,
        root: str,
        max_off_policy_steps: int,
        *,
        fresh: bool,
        fs: AbstractFileSystem | None = None,
        run_started: float | None = None,
        group: Any = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(fresh, bool):
            raise ConfigError(
                f"fresh must be True (a new run: wipe the root) or False (a resumed run), "
                f"found {fresh!r}"
            )
        self.root = PayloadRoot(root, fs, timeout=timeout)
        self.max_off_policy_steps = checked_int("max_off_policy_steps", max_off_policy_steps)
        self._lock = threading.Lock()
        self._deletion_done = threading.Condition(self._lock)
        self._claims: dict[str, int] = {}  # file -> latest step that claimed it
        self._swept: set[str] = set()  # claimed files their release leaves to the sweep
        self._discarded: set[str] = set()  # due at the next update unless claimed beyond it
        self._doomed: dict[str, float] = {}  # file -> when it was released, awaiting deletion
        self._deleting: set[str] = set()  # files whose deletion is under way
        self._bound = 0
        self._job: Future[None] | None = None
        self._again = False
        self._live = (0, 0)
        self._deleted = (0, 0)
        self._errors = 0
        self._latency = _Latency()
        self.group = group
        self._ranks = _Ranks(group) if group is not None else None
        self._outbox: dict[str, int] = {}  # a rank that does not delete: claims to send
        self._outbox_swept: set[str] = set()  # ... and which of them the sweep removes
        try:
            self.root.call("makedirs", self.root.path, exist_ok=True)
        except PermissionError as exc:
            raise PayloadPermissionError(
                f"payload root {self.root.url} may not be created: {exc}"
            ) from exc
        if fresh and self.deletes:
            _wipe_before(self.root, _process_started() if run_started is None else run_started)

    @property
    def deletes(self) -> bool:
        """True on the rank that deletes: the only one, or rank 0 of the group."""
        return self._ranks is None or self._ranks.rank == 0

    def __repr__(self) -> str:
        return f"PayloadRetention({self.root}, max_off_policy_steps={self.max_off_policy_steps})"

    def __enter__(self) -> PayloadRetention:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _names(self, files: Iterable[str]) -> list[str]:
        if isinstance(files, str):
            raise PayloadHandleError(f"files must be a collection of handles, found str {files!r}")
        return [self.root.relative(f) for f in files]

    def claim(self, step: int, files: Iterable[str], *, delete_on_release: bool = True) -> None:
        """Keep ``files`` until ``on_policy_update(s)`` with ``s >= step`` (and any later claim),
        then delete them, or with ``delete_on_release=False`` leave them to the version sweep."""
        step = checked_int("step", step)
        if not isinstance(delete_on_release, bool):
            raise ConfigError(f"delete_on_release must be a bool, found {delete_on_release!r}")
        names = self._names(files)
        with self._lock:
            if not self.deletes:
                for name in names:
                    self._outbox[name] = max(step, self._outbox.get(name, step))
                if not delete_on_release:
                    self._outbox_swept.update(names)
                return
            self._deletion_done.wait_for(lambda: self._deleting.isdisjoint(names))
            self._claim(step, names, swept=() if delete_on_release else names)

    def _claim(self, step: int, names: Iterable[str], swept: Iterable[str]) -> None:
        for name in names:
            self._claims[name] = max(step, self._claims.get(name, step))
            self._doomed.pop(name, None)
        self._swept.update(swept)

    def discard(self, files: Iterable[str]) -> None:
        """Delete ``files`` of dropped samples at the next ``on_policy_update``, unless a batch for
        a later step claims them by then."""
        names = self._names(files)
        with self._lock:
            self._discarded.update(names)

    def on_policy_update(self, step: int) -> None:
        """The trainer finished ``step``: delete what its batches claimed and what was discarded
        (unless claimed for a later step), and sweep stale versions. With a ``group``, every
        rank calls it with the same step (a collective; if one does not, every rank raises
        :class:`~r3data.errors.ConfigError` and every claim stays): rank 0 deletes once all have."""
        if self._ranks is None:
            step = checked_int("step", step)
        else:
            step = self._exchange(self._ranks, step)
            if not self.deletes:
                return
        bound = min_fresh_version(step + 1, self.max_off_policy_steps)
        now = time.monotonic()
        with self._lock:
            released = [name for name, claimed in self._claims.items() if claimed <= step]
            for name in released:
                del self._claims[name]
                if name in self._swept:
                    self._swept.discard(name)  # unclaimed now: the version sweep's
                else:
                    self._doomed.setdefault(name, now)
            for name in self._discarded:
                if name not in self._claims:  # claims left are for steps > step
                    self._doomed.setdefault(name, now)
            self._discarded.clear()
            self._bound = max(self._bound, bound)
        self._schedule()

    def _exchange(self, ranks: _Ranks, step: object) -> int:
        """Send this rank's claims and discards to rank 0, and ``step`` to every rank: all of them
        raise the same :class:`~r3data.errors.ConfigError` when the steps differ, each after every
        collective of the update (none is left waiting). Rank 0 merges every rank's claims before
        the check (more claims only keep files longer): none is lost to the error."""
        try:
            checked: int | None = checked_int("step", step)
        except ConfigError:
            checked = None  # the others learn of it as a mismatch, this rank below
        with self._lock:
            sent = (self._outbox, sorted(self._discarded), sorted(self._outbox_swept))
            self._outbox, self._discarded, self._outbox_swept = {}, set(), set()
        steps = ranks.all_gather(f"{step!r:.40}" if checked is None else checked)
        received = ranks.gather(sent)
        if self.deletes:
            self._merge(received)
        for rank, theirs in enumerate(steps):
            if theirs != steps[0]:
                raise ConfigError(
                    f"payload retention on {self.root.url}: rank {rank} finished step {theirs} "
                    f"while rank 0 finished {steps[0]}; every rank must call on_policy_update "
                    "with the same step"
                )
        return checked_int("step", step)  # every rank's was the same: raises if invalid

    def _merge(self, received: list[Any]) -> None:
        """Take every rank's claims, discards and swept files as this rank's own."""
        with self._lock:
            for claims, discarded, swept in received:
                by_step: dict[int, list[str]] = {}
                for name, claimed in claims.items():
                    by_step.setdefault(claimed, []).append(name)
                for claimed, names in by_step.items():
                    self._claim(claimed, names, swept=())
                self._swept.update(swept)
                self._discarded.update(discarded)

    def wait(self) -> None:
        """Block until no deletion is pending or running."""
        while True:
            with self._lock:
                job = self._job
            if job is None:
                return
            job.result()

    def close(self) -> None:
        """Wait for pending deletions."""
        self.wait()

    def metrics(self) -> RetentionMetrics:
        with self._lock:
            return RetentionMetrics(
                files_claimed=len(self._claims),
                files_pending=len(self._doomed.keys() | self._discarded),
                files_live=self._live[0],
                bytes_live=self._live[1],
                files_deleted=self._deleted[0],
                bytes_deleted=self._deleted[1],
                delete_errors=self._errors,
                deletion_latency_s_last=self._latency.last,
                deletion_latency_s_mean=self._latency.mean,
                deletion_latency_s_max=self._latency.max,
            )

    def _schedule(self) -> None:
        with self._lock:
            if self._job is not None:
                self._again = True
                return
            self._job = shared_pool().submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                doomed, bound = list(self._doomed), self._bound
                self._again = False
            try:
                self._work(doomed, bound)
            except Exception:  # the next call retries; the caller is never blocked or failed
                logger.exception("payload retention sweep of %s failed (retried later)", self.root)
            with self._lock:
                if not self._again:
                    self._job = None
                    return

    def _work(self, doomed: list[str], bound: int) -> None:
        """One pass: list the root, delete released and discarded files, sweep stale versions."""
        versions = list_versions(self.root)
        sizes = {name: size for files in versions.values() for name, size in files}
        gone = {name for name in doomed if self._delete(name, sizes.get(name, 0))}
        for version, files in versions.items():
            if version < bound:
                gone.update(
                    name for name, size in files if name not in gone and self._delete(name, size)
                )
                _remove_dir(self.root, version)
        live = [
            (name, size) for files in versions.values() for name, size in files if name not in gone
        ]
        with self._lock:
            self._live = (len(live), sum(size for _, size in live))

    def _delete(self, name: str, size: int) -> bool:
        """Delete ``name`` unless a batch claims it; True when it is gone.

        The claim check and the ``deleting`` mark are one step under the lock, and a claim of a
        file being deleted waits for the outcome: no claim returns while its file goes.
        """
        with self._lock:
            if name in self._claims:
                return False
            self._deleting.add(name)
        removed, failed = False, True
        try:
            self.root.remove(name)
            removed, failed = True, False
        except FileNotFoundError:
            failed = False
        except Exception as exc:
            logger.warning("could not delete payload file %s (retried later): %s", name, exc)
            if isinstance(exc, PayloadReadError):  # no answer in time: every other deletion
                raise  # of the pass would wait as long; the next pass retries them all
        finally:
            finished = time.monotonic()
            with self._lock:
                self._deleting.discard(name)
                self._deletion_done.notify_all()
                if failed:
                    self._errors += 1
                else:
                    self._discarded.discard(name)
                    since = self._doomed.pop(name, None)
                    if removed:
                        self._deleted = (self._deleted[0] + 1, self._deleted[1] + size)
                        if since is not None:
                            self._latency.add(finished - since)
        return not failed


class _Ranks:
    """The ranks sharing a root, as a ``torch.distributed`` group (imported only with one)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "PayloadRetention(group=...) needs an initialised torch.distributed process group"
            )
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)

    def all_gather(self, sent: Any) -> list[Any]:
        """Every rank's ``sent`` on every rank (in rank order)."""
        received: list[Any] = [None] * self.size
        self.dist.all_gather_object(received, sent, group=self.group)
        return received

    def gather(self, sent: Any) -> list[Any]:
        """Every rank's ``sent`` on rank 0 (in rank order); an empty list elsewhere."""
        received: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self.dist.gather_object(sent, received, dst=self.root, group=self.group)
        return received or []


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or, with ``dry_run``, would remove)."""

    root: str
    bound: int
    dry_run: bool
    versions: list[int]
    files: list[str]
    bytes: int
    errors: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    root: str,
    step: int,
    max_off_policy_steps: int,
    *,
    fs: AbstractFileSystem | None = None,
    dry_run: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> GcReport:
    """Remove versions no batch after ``step`` may use: ``v<k>`` with
    ``k < min_fresh_version(step + 1, max_off_policy_steps)`` (the retention backstop, offline).
    A store that does not answer a deletion within ``timeout`` stops the run there (reported
    in ``errors``): every other deletion would wait as long."""
    payload_root = PayloadRoot(root, fs, timeout=timeout)
    payload_root.require()
    bound = min_fresh_version(step + 1, max_off_policy_steps)
    versions, files, errors, nbytes = [], [], [], 0
    stale = [(v, listed) for v, listed in sorted(list_versions(payload_root).items()) if v < bound]
    due, tried = sum(len(listed) for _, listed in stale), 0
    for version, listed in stale:
        versions.append(version)
        for name, size in listed:
            if not dry_run:
                tried += 1
                try:
                    payload_root.remove(name)
                except FileNotFoundError:
                    continue
                except PayloadReadError as exc:  # no answer in time
                    errors.append(f"{name}: {exc}; stopped, {tried} of {due} files tried")
                    return GcReport(
                        payload_root.url, bound, dry_run, versions, files, nbytes, errors
                    )
                except (OSError, PayloadHandleError) as exc:  # a folder swapped for a link
                    errors.append(f"{name}: {exc}")
                    continue
            files.append(name)
            nbytes += size
        if not dry_run:
            _remove_dir(payload_root, version)
    return GcReport(payload_root.url, bound, dry_run, versions, files, nbytes, errors)
