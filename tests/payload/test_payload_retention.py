"""Retention: delete on consume, the version backstop, fresh and resumed runs, gc."""

from __future__ import annotations

import logging
import posixpath
import tempfile
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, PayloadHandleError
from r3data.payload import PayloadRetention, PayloadWriter, gc, min_fresh_version

ROW = np.zeros((3, 4), np.uint8)


def stored(root: str) -> set[str]:
    """Every file under the root, root-relative."""
    fs, path = fsspec.core.url_to_fs(root)
    return {posixpath.relpath(fs._strip_protocol(p), path) for p in fs.find(path)}


def write(writer: PayloadWriter, version: int) -> str:
    return writer.write(version, {"routes": ROW})[0].file


def new_root(kind: str) -> str:
    if kind == "local":
        return tempfile.mkdtemp(prefix="r3retention-")
    return f"memory://r3retention-{uuid.uuid4().hex}"


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_schedules_never_delete_early_and_delete_everything_eventually(data):
    kind = data.draw(st.sampled_from(["local", "memory"]), label="filesystem")
    max_off = data.draw(st.integers(0, 3), label="max_off_policy_steps")
    root = new_root(kind)
    fs, path = fsspec.core.url_to_fs(root)
    writer = PayloadWriter(root)
    retention = PayloadRetention(root, max_off)
    size_of: dict[str, int] = {}
    version_of: dict[str, int] = {}
    claimed: dict[str, int] = {}  # file -> latest step that claimed it
    discarded: set[str] = set()
    released = -1

    def must_exist() -> set[str]:
        return {f for f, step in claimed.items() if step > released}

    steps = data.draw(st.integers(1, 7), label="steps")
    for step in range(steps):
        for _ in range(data.draw(st.integers(0, 4), label="rollouts")):
            version = data.draw(st.integers(max(0, step - max_off - 2), step), label="version")
            name = write(writer, version)
            version_of[name] = version
            size_of[name] = fs.size(f"{path}/{name}")
        for batch in (step, step + 1):  # a prefetching loader ships the next batch early
            live = stored(root)
            candidates = sorted(
                f
                for f in live
                if f not in discarded
                and f not in claimed
                and version_of[f] >= min_fresh_version(batch, max_off)
            )
            picked = (
                data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
            )
            retention.claim(batch, picked)
            claimed.update(dict.fromkeys(picked, batch))
        unclaimed = sorted(f for f in stored(root) if f not in claimed and f not in discarded)
        dropped = data.draw(st.lists(st.sampled_from(unclaimed), unique=True)) if unclaimed else []
        retention.discard(dropped)
        discarded.update(dropped)
        assert must_exist() <= stored(root)
        retention.on_policy_update(step)
        released = step
        assert must_exist() <= stored(root)  # also while deletions run in the background
        retention.wait()
        bound = min_fresh_version(step + 1, max_off)
        expected = {
            f
            for f, version in version_of.items()
            if (f in claimed and claimed[f] > step)
            or (f not in claimed and f not in discarded and version >= bound)
        }
        assert stored(root) == expected
    retention.on_policy_update(steps + max_off + 1)
    retention.close()
    assert stored(root) == set()
    metrics = retention.metrics()
    assert metrics.files_deleted == len(version_of)
    assert metrics.bytes_deleted == sum(size_of.values())
    assert (metrics.files_live, metrics.bytes_live, metrics.files_pending) == (0, 0, 0)
    fs, path = fsspec.core.url_to_fs(root)
    fs.rm(path, recursive=True)


def test_min_fresh_version():
    assert [min_fresh_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    assert min_fresh_version(7, 0) == 7
    with pytest.raises(ConfigError, match="max_off_policy_steps must be an int >= 0"):
        min_fresh_version(3, -1)
    with pytest.raises(ConfigError, match="step"):
        min_fresh_version(2.0, 1)


def test_fresh_run_wipes_versions_and_resumed_run_keeps_them(payload_root):
    writer = PayloadWriter(payload_root)
    old = {write(writer, 0), write(writer, 3)}
    fs, path = fsspec.core.url_to_fs(payload_root)
    fs.pipe_file(f"{path}/notes.txt", b"not a payload")
    PayloadRetention(payload_root, 2, fresh=False).close()
    assert stored(payload_root) == old | {"notes.txt"}
    PayloadRetention(payload_root, 2, fresh=True).close()
    assert stored(payload_root) == {"notes.txt"}


def test_resumed_run_sweeps_what_the_old_run_left(tmp_path):
    root = str(tmp_path)
    writer = PayloadWriter(root)
    leftovers = {write(writer, 1), write(writer, 2)}
    (tmp_path / "v1" / ".dead.bin.tmp").write_bytes(b"half a file")
    keep = write(writer, 5)
    retention = PayloadRetention(root, 2, fresh=False)
    assert stored(root) == leftovers | {keep, "v1/.dead.bin.tmp"}
    retention.on_policy_update(4)  # the next batch may use versions >= 3
    retention.close()
    assert stored(root) == {keep}
    assert not (tmp_path / "v1").exists()
    assert retention.metrics().files_deleted == 3


def test_discard_spares_files_a_shipped_batch_claims(payload_root):
    writer = PayloadWriter(payload_root)
    shared, dropped = write(writer, 0), write(writer, 0)
    retention = PayloadRetention(payload_root, 1, fresh=False)
    retention.claim(0, [shared])
    retention.discard([shared, dropped])
    retention.wait()
    assert stored(payload_root) == {shared}
    retention.on_policy_update(0)
    retention.close()
    assert stored(payload_root) == set()
    with pytest.raises(PayloadHandleError, match="collection of handles"):
        retention.claim(1, shared)


class SlowDeletes(LocalFileSystem):
    """A local filesystem whose deletions take a while, and fail the first ``failures`` times."""

    def __init__(self, delay: float, failures: int = 0) -> None:
        super().__init__(skip_instance_cache=True)
        self.delay, self.failures, self.release = delay, failures, threading.Event()

    def rm_file(self, path):
        self.release.wait(self.delay)
        if self.failures:
            self.failures -= 1
            raise OSError(5, "Input/output error", path)
        super().rm_file(path)


def test_update_never_blocks_and_close_waits(tmp_path):
    fs = SlowDeletes(delay=10.0)
    writer = PayloadWriter(str(tmp_path))
    files = [write(writer, 0) for _ in range(3)]
    retention = PayloadRetention(str(tmp_path), 4, fs=fs, fresh=False)
    retention.claim(0, files)
    start = time.perf_counter()
    retention.on_policy_update(0)
    retention.on_policy_update(1)
    assert time.perf_counter() - start < 1.0
    assert stored(str(tmp_path)) == set(files)
    fs.release.set()
    retention.close()
    assert stored(str(tmp_path)) == set()
    metrics = retention.metrics()
    assert metrics.files_deleted == 3
    assert metrics.deletion_latency_s_max >= metrics.deletion_latency_s_mean > 0


def test_failed_deletions_are_logged_and_retried_next_time(tmp_path, caplog):
    fs = SlowDeletes(delay=0.0, failures=1)
    writer = PayloadWriter(str(tmp_path))
    first, second = write(writer, 0), write(writer, 0)
    retention = PayloadRetention(str(tmp_path), 4, fs=fs, fresh=False)
    retention.claim(0, [first, second])
    with caplog.at_level(logging.WARNING, logger="r3data.payload.retention"):
        retention.on_policy_update(0)
        retention.wait()
    assert "could not delete payload file" in caplog.text
    assert len(stored(str(tmp_path))) == 1
    metrics = retention.metrics()
    assert (metrics.delete_errors, metrics.files_pending, metrics.files_live) == (1, 1, 1)
    retention.on_policy_update(1)
    retention.close()
    assert stored(str(tmp_path)) == set()
    assert retention.metrics().files_pending == 0


def test_metrics_count_live_and_deleted_bytes(payload_root):
    writer = PayloadWriter(payload_root)
    fs, path = fsspec.core.url_to_fs(payload_root)
    files = [write(writer, v) for v in (0, 1, 2)]
    sizes = [fs.size(f"{path}/{f}") for f in files]
    retention = PayloadRetention(payload_root, 1, fresh=False)
    retention.claim(1, [files[1]])
    retention.on_policy_update(0)  # bound 0: nothing stale, nothing released
    retention.wait()
    assert (retention.metrics().files_live, retention.metrics().bytes_live) == (3, sum(sizes))
    retention.on_policy_update(1)  # releases files[1]; bound 1 sweeps version 0
    retention.close()
    metrics = retention.metrics()
    assert (metrics.files_deleted, metrics.bytes_deleted) == (2, sizes[0] + sizes[1])
    assert (metrics.files_live, metrics.bytes_live, metrics.files_claimed) == (1, sizes[2], 0)
    assert set(metrics.as_dict()) >= {"files_live", "bytes_deleted", "deletion_latency_s_mean"}


def test_gc_dry_run_then_real(payload_root):
    writer = PayloadWriter(payload_root)
    files = {v: write(writer, v) for v in range(5)}
    fs, path = fsspec.core.url_to_fs(payload_root)
    size = fs.size(f"{path}/{files[0]}")
    dry = gc(payload_root, step=3, max_off_policy_steps=2, dry_run=True)
    assert (dry.bound, dry.versions, dry.files, dry.bytes) == (
        2,
        [0, 1],
        [files[0], files[1]],
        2 * size,
    )
    assert stored(payload_root) == set(files.values())
    report = gc(payload_root, step=3, max_off_policy_steps=2)
    assert report.as_dict() == {**dry.as_dict(), "dry_run": False}
    assert stored(payload_root) == {files[2], files[3], files[4]}
