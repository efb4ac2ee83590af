"""Worker counts from a fake cgroup tree, and fill_rows semantics."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest

from r3data import parallel
from r3data.errors import ConfigError
from r3data.parallel import (
    fill_rows,
    in_pool_thread,
    io_workers,
    permitted_cpus,
    pool_workers,
)

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_no_cgroup_limit_uses_affinity(tmp_path):
    assert permitted_cpus(cgroup(tmp_path, {"cpu.max": "max 100000\n"})) == AFFINITY
    assert permitted_cpus(tmp_path / "absent") == AFFINITY


def test_cgroup_v2_quota_rounds_up(tmp_path):
    root = cgroup(tmp_path, {"cpu.max": "150000 100000\n"})
    assert permitted_cpus(root) == min(AFFINITY, 2)
    root = cgroup(tmp_path, {"cpu.max": "50000 100000\n"})
    assert permitted_cpus(root) == 1


def test_cgroup_v1_quota(tmp_path):
    root = cgroup(
        tmp_path,
        {"cpu,cpuacct/cpu.cfs_quota_us": "100000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
    )
    assert permitted_cpus(root) == 1
    unlimited = cgroup(
        tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    )
    assert permitted_cpus(unlimited) == AFFINITY


def test_malformed_cgroup_files_are_ignored(tmp_path):
    assert permitted_cpus(cgroup(tmp_path, {"cpu.max": "lots 100000"})) == AFFINITY
    assert permitted_cpus(cgroup(tmp_path / "z", {"cpu.max": "100000 0"})) == AFFINITY
    bad_v1 = {"cpu/cpu.cfs_quota_us": "x", "cpu/cpu.cfs_period_us": "100000"}
    assert permitted_cpus(cgroup(tmp_path / "v1", bad_v1)) == AFFINITY


def test_pool_workers_honours_quota_reserve_cap_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("R3DATA_WORKERS", raising=False)
    monkeypatch.delenv("R3DATA_IO_WORKERS", raising=False)
    root = cgroup(tmp_path, {"cpu.max": "100000 100000"})
    assert pool_workers(cgroup_root=root) == 1
    assert pool_workers(reserve=5, cgroup_root=root) == 1
    assert io_workers(cgroup_root=root) == 8
    assert io_workers(cap=3, cgroup_root=root) == 3
    monkeypatch.setenv("R3DATA_WORKERS", "6")
    assert pool_workers(cgroup_root=root) == 6
    assert pool_workers(cap=4, cgroup_root=root) == 4
    monkeypatch.setenv("R3DATA_IO_WORKERS", "3")
    assert io_workers(cgroup_root=root) == 3
    monkeypatch.setenv("R3DATA_WORKERS", "zero")
    with pytest.raises(ConfigError, match="R3DATA_WORKERS must be an integer >= 1, found 'zero'"):
        pool_workers()


def test_fill_rows_returns_in_order_and_runs_concurrently():
    running, peak, lock = [0], [0], threading.Lock()
    together = threading.Barrier(3, timeout=10)  # passes only if three items run at once

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        if i < 3:
            together.wait()
        with lock:
            running[0] -= 1
        return i * i

    assert fill_rows(work, 12, workers=3) == [i * i for i in range(12)]
    assert peak[0] == 3  # never more than ``workers``


def test_fill_rows_reports_the_failing_index_and_waits_for_every_lane():
    finished: list[int] = []

    def work(i: int) -> int:
        if i == 4:
            raise KeyError("bad sample")
        time.sleep(0.005)
        finished.append(i)
        return i

    with pytest.raises(KeyError) as info:
        fill_rows(work, 20, workers=3)
    assert info.value.r3data_index == 4
    assert "filling item 4" in info.value.__notes__[0]
    settled = list(finished)
    time.sleep(0.05)
    assert finished == settled  # no lane is still running after the call returned


def test_a_nested_failure_reports_the_outer_index():
    def outer(i: int) -> None:
        def inner(j: int) -> None:
            if i == 3:
                raise ValueError("inner failure")

        fill_rows(inner, 2, workers=2)

    with pytest.raises(ValueError, match="inner failure") as info:
        fill_rows(outer, 5, workers=2)
    assert info.value.r3data_index == 3


def test_nested_fill_rows_runs_inline_in_pool_threads():
    def outer(i: int) -> list[bool]:
        return fill_rows(lambda _: in_pool_thread(), 3, workers=4)

    results = fill_rows(outer, 4, workers=2)
    assert results == [[True] * 3] * 4
    assert fill_rows(lambda _: in_pool_thread(), 3, workers=1) == [False] * 3
    with pytest.raises(ConfigError, match="workers must be >= 1, found 0"):
        fill_rows(lambda i: i, 3, workers=0)


def test_the_machines_own_count_is_read_again_only_after_its_ttl(monkeypatch):
    reads = []
    monkeypatch.setattr(parallel, "_read_permitted_cpus", lambda root: reads.append(root) or 3)
    monkeypatch.setattr(parallel, "_permitted", None)
    clock = [100.0]
    monkeypatch.setattr(parallel.time, "monotonic", lambda: clock[0])
    assert [permitted_cpus(), permitted_cpus()] == [3, 3]
    assert len(reads) == 1
    clock[0] += parallel.PERMITTED_CPUS_TTL_S + 1
    assert permitted_cpus() == 3
    assert len(reads) == 2


def test_the_quota_of_the_process_own_cgroup_and_its_parents_counts(tmp_path, monkeypatch):
    """Without a cgroup namespace (a systemd service's CPUQuota=, a batch job's step, a
    container runtime sharing the host's view) the process sits below the mount's root, whose
    cpu.max does not exist or says max: only the root's quota was read."""
    monkeypatch.setattr(parallel, "_affinity_cpus", lambda: 8)  # a quota of 1 must show
    own = cgroup(tmp_path, {"self": "0::/system.slice/trainer.service\n"}) / "self"
    service = {"cpu.max": "max 100000", "system.slice/cpu.max": "max 100000"}
    service["system.slice/trainer.service/cpu.max"] = "50000 100000"
    assert permitted_cpus(cgroup(tmp_path / "a", service), self_cgroup=own) == 1
    parent = {"system.slice/cpu.max": "100000 100000"}
    parent["system.slice/trainer.service/cpu.max"] = "max 100000"
    assert permitted_cpus(cgroup(tmp_path / "b", parent), self_cgroup=own) == 1
    v1 = cgroup(
        tmp_path / "v1",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "100000",
            "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000",
        },
    )
    own_v1 = cgroup(tmp_path, {"self-v1": "4:memory:/elsewhere\n2:cpu,cpuacct:/kubepods/pod1\n"})
    assert permitted_cpus(v1, self_cgroup=own_v1 / "self-v1") == 1
    # a path the mount does not show (it is the container's own cgroup): its root counts
    moved = cgroup(tmp_path, {"self-moved": "0::/docker/abc\n"}) / "self-moved"
    assert permitted_cpus(tmp_path / "a", self_cgroup=moved) == 8
    assert permitted_cpus(tmp_path / "a", self_cgroup=tmp_path / "absent") == 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_fills_on_a_pool_of_its_own():
    """A child forked after the parent used the pool inherits none of its threads: its fills
    run on a new pool instead of waiting forever on the parent's dead workers."""
    lanes = io_workers()  # the pool's size: every one of its threads started, then idle
    assert fill_rows(lambda i: time.sleep(0.05) or i, lanes, workers=lanes) == list(range(lanes))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the fill's result, or nothing if it hangs
        try:
            os.close(read)
            result = fill_rows(lambda i: i + 1, 8, workers=2)
            os.write(write, repr(result).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 20)
        got = os.read(read, 1000).decode() if ready else "hung"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert got == repr([i + 1 for i in range(8)])
