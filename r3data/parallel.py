"""Worker counts that respect the container, and one shared bounded thread pool.

A trainer's container often has a CPU quota far below ``os.cpu_count()``; sizing a pool from
the host's count oversubscribes the quota and stalls the training loop. Counts here come from
the CPU affinity mask and the cgroup (v2 ``cpu.max``, v1 CFS quota), whichever is smallest.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from r3data.errors import ConfigError

T = TypeVar("T")

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
"""Where the kernel says which cgroup this process is in (``hierarchy:controllers:path``)."""
V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
WORKERS_ENV = "R3DATA_WORKERS"
IO_WORKERS_ENV = "R3DATA_IO_WORKERS"
IO_WORKERS_PER_CPU = 4
IO_WORKERS_MIN = 8
IO_WORKERS_MAX = 32
#: The machine's own quota is read again after this many seconds (a live resize is rare; the
#: read costs about 100 us, too much for every fill).
PERMITTED_CPUS_TTL_S = 5.0

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_in_pool = threading.local()
_permitted: tuple[float, int] | None = None  # (when read, count) for CGROUP_ROOT


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_v2_cpus(root: Path) -> float | None:
    text = _read(root / "cpu.max")
    if text is None:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None  # unlimited, or a file we cannot read: no limit from it
    return int(quota) / int(period)


def _cgroup_v1_cpus(folder: Path) -> float | None:
    quota = _read(folder / "cpu.cfs_quota_us")
    period = _read(folder / "cpu.cfs_period_us")
    if quota and period and quota.isdigit() and period.isdigit() and int(period) > 0:
        return int(quota) / int(period) or None
    return None


def _own_paths(self_cgroup: Path) -> tuple[str, str]:
    """This process's cgroup path in the v2 hierarchy and in v1's ``cpu`` one ("/" if none)."""
    v2 = v1 = "/"
    for line in (_read(self_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path or "/"
        elif "cpu" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _lineage(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each of its parents up to ``mount``, those that exist: a quota on
    any of them limits the process. A path the mount does not show (the mount is already the
    process's own cgroup, as inside a container) leaves the mount alone."""
    folders = [mount]
    for part in (p for p in path.split("/") if p):
        folders.append(folders[-1] / part)
    return [f for f in folders[1:] if f.is_dir()] + [mount]


def permitted_cpus(
    cgroup_root: Path | str = CGROUP_ROOT, self_cgroup: Path | str = SELF_CGROUP
) -> int:
    """CPUs this process may use: min(affinity, cgroup v2 quota, cgroup v1 quota), at least 1;
    the quotas of the process's own cgroup (``self_cgroup`` names it) and of every parent
    below ``cgroup_root`` count.

    The machine's own count (``CGROUP_ROOT``) is kept for ``PERMITTED_CPUS_TTL_S`` seconds.
    """
    global _permitted
    if Path(cgroup_root) != CGROUP_ROOT or Path(self_cgroup) != SELF_CGROUP:
        return _read_permitted_cpus(Path(cgroup_root), Path(self_cgroup))
    now = time.monotonic()
    if _permitted is None or now - _permitted[0] > PERMITTED_CPUS_TTL_S:
        _permitted = (now, _read_permitted_cpus(CGROUP_ROOT))
    return _permitted[1]


def _read_permitted_cpus(root: Path, self_cgroup: Path = SELF_CGROUP) -> int:
    limits = [float(_affinity_cpus())]
    v2, v1 = _own_paths(self_cgroup)
    quotas = [_cgroup_v2_cpus(folder) for folder in _lineage(root, v2)]
    for name in V1_CPU_FOLDERS:
        quotas += [_cgroup_v1_cpus(folder) for folder in _lineage(root / name, v1)]
    limits += [quota for quota in quotas if quota is not None]
    return max(1, math.ceil(min(limits)))


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, found {raw!r}")
    return value


def pool_workers(
    cap: int | None = None, reserve: int = 0, cgroup_root: Path | str = CGROUP_ROOT
) -> int:
    """Workers for CPU-bound work: permitted CPUs less ``reserve``, at most ``cap``, at least 1.

    ``R3DATA_WORKERS`` overrides the computed count (``cap`` still applies).
    """
    count = _env_count(WORKERS_ENV) or permitted_cpus(cgroup_root) - reserve
    if cap is not None:
        count = min(count, cap)
    return max(1, count)


def io_workers(cap: int = IO_WORKERS_MAX, cgroup_root: Path | str = CGROUP_ROOT) -> int:
    """Workers for latency-bound I/O (threads mostly wait): a multiple of the permitted CPUs.

    ``R3DATA_IO_WORKERS`` overrides the computed count.
    """
    count = _env_count(IO_WORKERS_ENV) or max(
        IO_WORKERS_MIN, IO_WORKERS_PER_CPU * permitted_cpus(cgroup_root)
    )
    return max(1, min(count, cap))


def _mark_pool_thread() -> None:
    _in_pool.active = True


def shared_pool() -> ThreadPoolExecutor:
    """The process-wide bounded pool for I/O and row fills (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=io_workers(),
                thread_name_prefix="r3data",
                initializer=_mark_pool_thread,
            )
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child has none of the pool's threads (nor a lock another thread held): it
    makes a pool of its own on first use instead of queueing work for dead workers."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    _in_pool.active = False


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def in_pool_thread() -> bool:
    """True inside a shared-pool worker, where nested parallel work must run inline."""
    return getattr(_in_pool, "active", False)


def fill_rows(fill_fn: Callable[[int], T], n: int, workers: int | None = None) -> list[T]:
    """Call ``fill_fn(i)`` for ``i in range(n)`` with at most ``workers`` running at once.

    Results come back in order. The first failure is re-raised as it was, with the index
    recorded in a note (and as ``exc.r3data_index``). One worker, one item, or a call from
    inside a pool worker (where waiting on the pool could deadlock) runs inline.
    """
    workers = pool_workers() if workers is None else workers
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, found {workers}")
    if workers == 1 or n <= 1 or in_pool_thread():
        return [_call(fill_fn, i) for i in range(n)]
    results: list[T] = [None] * n  # type: ignore[list-item]
    claims = itertools.count()  # lanes pull the next index: long items do not stall a lane
    stop = threading.Event()

    def lane() -> None:
        while not stop.is_set() and (i := next(claims)) < n:
            try:
                results[i] = _call(fill_fn, i)
            except BaseException:
                stop.set()
                raise

    futures = [shared_pool().submit(lane) for _ in range(min(workers, n))]
    failures = [f.exception() for f in futures]  # waits for every lane: none outlives the call
    failure = next((exc for exc in failures if exc is not None), None)
    if failure is not None:
        raise failure
    return results


def _call(fill_fn: Callable[[int], T], i: int) -> T:
    try:
        return fill_fn(i)
    except Exception as exc:
        # Nested calls annotate first; the outermost (the caller's own index) is set last.
        exc.r3data_index = i  # type: ignore[attr-defined]
        if hasattr(exc, "add_note"):
            exc.add_note(f"r3data: raised while filling item {i}")
        raise
