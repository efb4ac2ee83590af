"""Retention: delete on consume, the version backstop, fresh and resumed runs, gc."""

from __future__ import annotations

import logging
import posixpath
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, PayloadHandleError
from r3data.payload import PayloadRetention, PayloadWriter, gc, min_fresh_version

ROW = np.zeros((3, 4), np.uint8)


def stored(root: str, fs=None) -> set[str]:
    """Every file under the root, root-relative."""
    fs, path = fsspec.core.url_to_fs(root) if fs is None else (fs, root)
    return {posixpath.relpath(fs._strip_protocol(p), path) for p in fs.find(path)}


def write(writer: PayloadWriter, version: int) -> str:
    return writer.write(version, {"routes": ROW})[0].file


def new_root(kind: str, tmp_path_factory) -> str:
    if kind == "local":
        return str(tmp_path_factory.mktemp("retention"))
    return f"memory://r3retention-{uuid.uuid4().hex}"


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_schedules_never_delete_early_and_delete_everything_eventually(
    tmp_path_factory, data
):
    kind = data.draw(st.sampled_from(["local", "memory"]), label="filesystem")
    max_off = data.draw(st.integers(0, 3), label="max_off_policy_steps")
    root = new_root(kind, tmp_path_factory)
    fs, path = fsspec.core.url_to_fs(root)
    try:
        with PayloadRetention(root, max_off, fresh=True) as retention:
            check_schedule(data, root, retention)
    finally:
        if fs.exists(path):
            fs.rm(path, recursive=True)


def check_schedule(data, root: str, retention: PayloadRetention) -> None:
    """Drive a random schedule and check the files left after every call against a model."""
    fs, path = fsspec.core.url_to_fs(root)
    max_off = retention.max_off_policy_steps
    writer = PayloadWriter(root)
    size_of: dict[str, int] = {}
    version_of: dict[str, int] = {}
    claims: dict[str, int] = {}  # file -> latest step that claimed it, until released
    swept: set[str] = set()  # claimed files a claim left to the sweep (a stream's), until released
    discarded: set[str] = set()  # since the last update
    deleted: set[str] = set()

    steps = data.draw(st.integers(1, 7), label="steps")
    for step in range(steps):
        for _ in range(data.draw(st.integers(0, 4), label="rollouts")):
            version = data.draw(st.integers(max(0, step - max_off - 2), step), label="version")
            name = write(writer, version)
            version_of[name] = version
            size_of[name] = fs.size(f"{path}/{name}")
        # a prefetching loader ships the next batch early; a file may be claimed by both (a
        # group split across batches), and dropped from one batch while another uses it
        for batch in data.draw(st.permutations([step, step + 1]), label="claim order"):
            live = [f for f in version_of if f not in deleted]  # in write order: names are random
            fresh = [f for f in live if version_of[f] >= min_fresh_version(batch, max_off)]
            picked = data.draw(st.lists(st.sampled_from(fresh), unique=True)) if fresh else []
            streamed = data.draw(st.booleans(), label="left to the sweep")
            retention.claim(batch, picked, delete_on_release=not streamed)
            claims.update({f: max(batch, claims.get(f, batch)) for f in picked})
            if streamed:
                swept.update(picked)
            dropped = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
            retention.discard(dropped)
            discarded.update(dropped)
        retention.wait()
        assert stored(root) == set(version_of) - deleted  # claims and discards delete nothing
        metrics = retention.metrics()
        assert (metrics.files_claimed, metrics.files_pending) == (len(claims), len(discarded))

        released = {f for f, claimed in claims.items() if claimed <= step}
        due = (released - swept) | {f for f in discarded if claims.get(f, step) <= step}
        for f in released:
            del claims[f]
            swept.discard(f)
        discarded.clear()
        bound = min_fresh_version(step + 1, max_off)
        deleted |= due | {f for f, v in version_of.items() if v < bound and f not in claims}
        retention.on_policy_update(step)
        assert set(version_of) - deleted <= stored(root)  # also while deletions run
        retention.wait()
        assert stored(root) == set(version_of) - deleted
    retention.on_policy_update(steps + max_off + 1)
    retention.close()
    assert stored(root) == set()
    metrics = retention.metrics()
    assert metrics.files_deleted == len(version_of)
    assert metrics.bytes_deleted == sum(size_of.values())
    assert (metrics.files_live, metrics.bytes_live, metrics.files_pending) == (0, 0, 0)


def test_min_fresh_version():
    assert [min_fresh_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    assert min_fresh_version(7, 0) == 7
    with pytest.raises(ConfigError, match="max_off_policy_steps: expected an int >= 0"):
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
    PayloadRetention(payload_root, 2, fresh=True, run_started=time.time() + 10).close()
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


def test_fresh_has_no_default_and_must_be_a_bool(payload_root):
    kept = {write(PayloadWriter(payload_root), 0)}
    with pytest.raises(TypeError, match="fresh"):
        PayloadRetention(payload_root, 2)
    with pytest.raises(ConfigError, match=r"fresh must be True .* or False .* found 'no'"):
        PayloadRetention(payload_root, 2, fresh="no")
    assert stored(payload_root) == kept


def test_discarded_files_go_at_the_next_update_unless_a_later_batch_claims_them(payload_root):
    writer = PayloadWriter(payload_root)
    shared, early, dropped, used = (write(writer, 0) for _ in range(4))
    retention = PayloadRetention(payload_root, 4, fresh=False)
    retention.claim(0, [used, dropped])
    retention.claim(1, [early])  # batch 1 was prefetched and shipped before batch 0's discard
    retention.discard([shared, early, dropped])  # samples dropped from batch 0
    retention.wait()
    assert stored(payload_root) == {shared, early, dropped, used}  # nothing goes before an update
    assert retention.metrics().files_pending == 3
    retention.claim(1, [shared])  # batch 1 shares a file with a sample dropped from batch 0
    retention.on_policy_update(0)
    retention.wait()
    assert stored(payload_root) == {shared, early}
    assert (retention.metrics().files_pending, retention.metrics().files_claimed) == (0, 2)
    retention.on_policy_update(1)
    retention.close()
    assert stored(payload_root) == set()
    assert retention.metrics().files_deleted == 4
    with pytest.raises(PayloadHandleError, match="collection of handles"):
        retention.discard(shared)


def test_a_claim_that_does_not_delete_on_release_leaves_the_file_to_the_sweep(payload_root):
    writer = PayloadWriter(payload_root)
    streamed, consumed, later = write(writer, 0), write(writer, 0), write(writer, 1)
    retention = PayloadRetention(payload_root, 1, fresh=False)
    retention.claim(0, [streamed, later], delete_on_release=False)
    retention.claim(0, [consumed])
    retention.on_policy_update(0)  # sweeps versions < 0: nothing
    retention.wait()
    assert stored(payload_root) == {streamed, later}
    retention.claim(2, [later], delete_on_release=False)  # a later sample names it again
    retention.on_policy_update(1)  # sweeps versions < 1, unclaimed
    retention.wait()
    assert stored(payload_root) == {later}
    retention.on_policy_update(2)
    retention.close()
    assert stored(payload_root) == set()
    with pytest.raises(ConfigError, match="delete_on_release must be a bool, found 'no'"):
        retention.claim(3, [later], delete_on_release="no")


def test_a_file_stays_until_its_latest_claim_is_released(payload_root):
    writer = PayloadWriter(payload_root)
    twice, once = write(writer, 0), write(writer, 0)
    retention = PayloadRetention(payload_root, 4, fresh=False)
    retention.claim(2, [twice])
    retention.claim(1, [twice, once])  # an earlier step claimed after a later one
    retention.on_policy_update(1)
    retention.wait()
    assert stored(payload_root) == {twice}
    assert retention.metrics().files_claimed == 1
    retention.claim(3, [twice])
    retention.on_policy_update(2)
    retention.wait()
    assert stored(payload_root) == {twice}
    retention.on_policy_update(3)
    retention.close()
    assert stored(payload_root) == set()


def test_nothing_is_held_for_the_files_deleted(payload_root):
    writer = PayloadWriter(payload_root)
    retention = PayloadRetention(payload_root, 0, fresh=False)
    held = []
    for step in range(3):
        files = [write(writer, step) for _ in range(20)]
        retention.claim(step, files[:10])
        retention.discard(files[10:])
        retention.on_policy_update(step)
        retention.wait()
        metrics = retention.metrics()
        held.append((metrics.files_claimed, metrics.files_pending, metrics.files_live))
    assert stored(payload_root) == set()
    assert held == [(0, 0, 0)] * 3
    metrics = retention.metrics()
    assert (metrics.files_deleted, metrics.delete_errors) == (60, 0)
    assert 0 < metrics.deletion_latency_s_mean <= metrics.deletion_latency_s_max
    assert 0 < metrics.deletion_latency_s_last <= metrics.deletion_latency_s_max


class HeldDeletes(MemoryFileSystem):
    """A private memory:// store whose deletions wait for ``release``, and fail the first
    ``failures`` times (a local-backed root deletes through the kernel, not ``rm_file``).

    ``started`` is set when a deletion begins; ``deleting`` lists the paths begun.
    """

    cachable = False  # each test gets its own events and counts

    def __init__(self, failures: int = 0) -> None:
        super().__init__(global_store=False)
        self.failures = failures
        self.release, self.started = threading.Event(), threading.Event()
        self.deleting: list[str] = []

    def rm_file(self, path):
        self.deleting.append(path)
        self.started.set()
        self.release.wait()
        if self.failures:
            self.failures -= 1
            raise OSError(5, "Input/output error", path)
        super().rm_file(path)


HELD_ROOT = "/r3test-held"


@pytest.fixture
def held_deletes():
    """Makes :class:`HeldDeletes`; releases them all when the test ends, passed or failed."""
    made: list[HeldDeletes] = []

    def make(failures: int = 0) -> HeldDeletes:
        made.append(HeldDeletes(failures))
        return made[-1]

    yield make
    for fs in made:
        fs.release.set()


def test_update_never_blocks_and_close_waits(held_deletes):
    fs = held_deletes()
    writer = PayloadWriter(HELD_ROOT, fs=fs)
    files = [write(writer, 0) for _ in range(3)]
    retention = PayloadRetention(HELD_ROOT, 4, fs=fs, fresh=False)
    retention.claim(0, files)

    def updates() -> None:
        retention.on_policy_update(0)
        retention.on_policy_update(1)

    updater = threading.Thread(target=updates, daemon=True)
    updater.start()
    updater.join(5.0)
    assert fs.started.wait(5.0)
    assert not updater.is_alive()  # both calls returned...
    assert not fs.release.is_set()  # ...while the first deletion is still held
    assert stored(HELD_ROOT, fs) == set(files)
    fs.release.set()
    retention.close()
    assert stored(HELD_ROOT, fs) == set()
    metrics = retention.metrics()
    assert metrics.files_deleted == 3
    assert metrics.deletion_latency_s_max >= metrics.deletion_latency_s_mean > 0


def start_deleting(fs: HeldDeletes, count: int) -> tuple[PayloadRetention, list[str]]:
    """Release ``count`` files; returns once the worker is inside the first deletion (held)."""
    writer = PayloadWriter(HELD_ROOT, fs=fs)
    files = [write(writer, 0) for _ in range(count)]
    retention = PayloadRetention(HELD_ROOT, 4, fs=fs, fresh=False)
    retention.claim(0, files)
    retention.on_policy_update(0)
    assert fs.started.wait(5.0)
    busy = next(f for f in files if fs.deleting[0].endswith(f))
    return retention, [busy, *(f for f in files if f != busy)]


def claim_in_thread(retention: PayloadRetention, step: int, files: list[str]) -> threading.Event:
    """Claim on another thread; the event is set as soon as ``claim`` returns."""
    returned = threading.Event()

    def claim() -> None:
        retention.claim(step, files)
        returned.set()

    threading.Thread(target=claim, daemon=True).start()
    return returned


def test_a_claim_racing_a_deletion_waits_for_it(held_deletes):
    fs = held_deletes()
    retention, (busy, queued) = start_deleting(fs, 2)
    racing = claim_in_thread(retention, 1, [busy])
    # a claim of a file not begun keeps it at once, while the deletion is held...
    assert claim_in_thread(retention, 1, [queued]).wait(5.0)
    assert not racing.wait(0.2)  # ...and the claim of the file being deleted waits for it
    assert not fs.release.is_set()
    fs.release.set()
    assert racing.wait(5.0)
    retention.wait()
    assert stored(HELD_ROOT, fs) == {queued}  # `busy` went before its claim took effect
    assert len(fs.deleting) == 1
    retention.on_policy_update(1)
    retention.close()
    assert stored(HELD_ROOT, fs) == set()
    assert retention.metrics().files_deleted == 2


def test_a_claim_waiting_on_a_failed_deletion_keeps_the_file(held_deletes):
    fs = held_deletes(failures=1)
    retention, (busy,) = start_deleting(fs, 1)
    racing = claim_in_thread(retention, 1, [busy])
    assert not racing.wait(0.2)
    assert not fs.release.is_set()
    fs.release.set()
    assert racing.wait(5.0)
    retention.on_policy_update(0)  # the failed deletion is not retried: `busy` is claimed now
    retention.wait()
    assert stored(HELD_ROOT, fs) == {busy}
    metrics = retention.metrics()
    assert (metrics.delete_errors, metrics.files_claimed, metrics.files_pending) == (1, 1, 0)
    retention.on_policy_update(1)
    retention.close()
    assert stored(HELD_ROOT, fs) == set()


def test_failed_deletions_are_logged_and_retried_next_time(held_deletes, caplog):
    fs = held_deletes(failures=1)
    fs.release.set()
    writer = PayloadWriter(HELD_ROOT, fs=fs)
    first, second = write(writer, 0), write(writer, 0)
    retention = PayloadRetention(HELD_ROOT, 4, fs=fs, fresh=False)
    retention.claim(0, [first, second])
    with caplog.at_level(logging.WARNING, logger="r3data.payload.retention"):
        retention.on_policy_update(0)
        retention.wait()
    assert "could not delete payload file" in caplog.text
    assert len(stored(HELD_ROOT, fs)) == 1
    metrics = retention.metrics()
    assert (metrics.delete_errors, metrics.files_pending, metrics.files_live) == (1, 1, 1)
    retention.on_policy_update(1)
    retention.close()
    assert stored(HELD_ROOT, fs) == set()
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


def test_ranks_where_only_one_leaves_files_to_the_sweep(tmp_path):
    """Rank 1's claims that leave files to the sweep reach rank 0, the one deleting: released,
    those stay (even one rank 0 claimed to delete: a later sample of rank 1's stream may name
    it) until their version is swept; the rest go at once."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
    from rank_helpers import spawn_ranks
    from retention_ranks import mixed_claims

    root = tmp_path / "payloads"
    writer = PayloadWriter(str(root))
    files = [write(writer, 1) for _ in range(3)]
    streamed, consumed, shared = files
    args = (2, str(tmp_path / "store"), str(root), files)
    reports = spawn_ranks(mixed_claims, 2, args, deadline_s=60)
    assert consumed not in reports[0]["left"][0]
    assert reports[0]["left"] == reports[1]["left"] == [sorted([streamed, shared]), []]
    metrics = reports[0]["metrics"]
    assert (metrics["files_deleted"], metrics["files_claimed"], metrics["files_pending"]) == (
        3,
        0,
        0,
    )
