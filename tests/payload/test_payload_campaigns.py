"""The attack campaigns, bounded and seeded, on every local-backed filesystem class (and the
flaky and retention ones on memory:// too): a few thousand cases in all, seconds each."""

from __future__ import annotations

import posixpath
import random
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile
from payload_campaigns import (
    LOCAL_CLASSES,
    Spellings,
    confined_deletions,
    escape_campaign,
    fill_disk_campaign,
    flaky,
    flaky_reads_campaign,
    forkserver,
    killed_writer_campaign,
    local_classes,
    moved,
    plant_hostile_tree,
    retention_campaign,
    routes,
    swapping_tree_campaign,
    symlink_campaign,
)
from store_helpers import MemoryBacked

from r3data.errors import PayloadWriteError
from r3data.payload import PayloadWriter


def make_root(tmp_path: Path, kind: str):
    base = tmp_path / "base"
    base.mkdir(parents=True, exist_ok=True)
    return base, *local_classes(base)[kind]()


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_handle_escapes_on_every_local_backed_class(tmp_path, kind):
    base, root, fs = make_root(tmp_path, kind)
    rng = np.random.default_rng(1)
    data = routes(rng, 40)
    (segment,) = PayloadWriter(root, fs=fs).write(1, {"routes": data})
    (base / "payloads" / segment.file).rename(base / "payloads" / "v1" / "a.bin")
    segment = moved(segment, "v1/a.bin")
    secret = bytes(np.full(segment.offset + segment.nbytes, 0xEE, np.uint8))
    outside = plant_hostile_tree(base, secret)
    os_root = str(base / "payloads")
    counts = symlink_campaign(root, fs, os_root, segment, random.Random(kind), 600)
    assert min(counts.values()) > 20, counts  # every outcome was exercised
    whole_root = os_root if kind in ("LocalFileSystem", "subclass") else "/" + root
    spellings = Spellings(
        root_prefixes=[whole_root + "/", "file://" + os_root + "/"],
        outside={
            str(outside / "v1" / "a.bin"): secret,
            posixpath.join(posixpath.dirname(whole_root), "outside", "v1", "a.bin"): secret,
            "file://" + str(outside / "passwd"): secret,
        },
    )
    counts = escape_campaign(
        root, fs, spellings, {"v1/a.bin": segment}, {"v1/a.bin": data}, random.Random(2), 300
    )
    assert counts["read"] > 50, counts
    assert counts["refused"] > 50, counts
    confined_deletions(root, fs, outside)


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_a_tree_changing_under_a_running_reader_never_leaks_outside_bytes(tmp_path, kind):
    base, root, fs = make_root(tmp_path, kind)
    data = routes(np.random.default_rng(3), 64)
    (segment,) = PayloadWriter(root, fs=fs).write(2, {"routes": data})
    counts = swapping_tree_campaign(root, fs, base, segment, data, 600)
    assert counts["read"] > 0, counts
    assert counts["refused"] > 0, counts


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_writers_killed_at_random_points_never_leave_a_partial_file(tmp_path, kind):
    _, root, fs = make_root(tmp_path, kind)
    counts = killed_writer_campaign(root, fs, random.Random(kind), 6, 6000, 0.06)
    assert counts["published"] > 0, counts


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory) -> Iterator[Path | None]:
    """A 3 MiB tmpfs where mounting is allowed (root in CI), else None."""
    mount = tmp_path_factory.mktemp("small-disk")
    command = ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)]
    try:
        mounted = subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    yield mount if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def fill_disk_with_a_file_size_limit(root: str, fs, seed: int, out) -> None:
    """The fallback's child: files beyond 1 MiB fail as on a full disk (``RLIMIT_FSIZE``)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    out.send(fill_disk_campaign(root, fs, seed, 25, 5000))


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_a_full_disk_fails_writes_cleanly(small_disk, tmp_path, kind):
    base, root, fs = make_root(small_disk / kind if small_disk else tmp_path, kind)
    if small_disk is not None:
        counts = fill_disk_campaign(root, fs, 7, 30, 5000)
    else:  # no mount allowed here: a file size limit in a child stands in for the full disk
        context = forkserver()
        parent, child = context.Pipe(duplex=False)
        process = context.Process(
            target=fill_disk_with_a_file_size_limit, args=(root, fs, 7, child)
        )
        process.start()
        assert parent.poll(120)
        counts = parent.recv()
        process.join(30)
    shutil.rmtree(base)  # the small disk is shared by the classes
    assert counts["failed"] > 0, counts
    assert counts["published"] > 0, counts


class WriteThrough(AbstractBufferedFile):
    """A file shown from its first flushed block on (as on SFTP or SMB), failing with a full
    disk once its store holds ``room`` bytes."""

    def _initiate_upload(self) -> None:
        self.fs.objects.pipe_file(self.path, b"")

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.fs.objects.cat_file(self.path) + self.buffer.getvalue()
        self.fs.objects.pipe_file(self.path, data[: self.fs.room])
        if len(data) > self.fs.room:
            raise OSError(28, "No space left on device", self.path)
        return True


class VisibleWhileWritten(MemoryBacked):
    protocol = "visible"

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def _open(self, path, mode="rb", **kwargs):
        return WriteThrough(self, path, mode, block_size=4096)


def test_any_filesystem_deletes_what_a_failed_write_left():
    fs = VisibleWhileWritten(room=20_000)
    with pytest.raises(PayloadWriteError, match="No space left"):
        PayloadWriter("/r3-visible", fs=fs).write(1, {"routes": np.zeros((100, 48, 8), np.uint8)})
    assert fs.objects.find("/r3-visible") == []


@pytest.mark.parametrize("seed", [11, 12])
def test_flaky_reads_return_exact_bytes_or_typed_errors(seed):
    fs = flaky(MemoryFileSystem)(rate=0.12, seed=seed, global_store=False)
    counts = flaky_reads_campaign(f"/r3-flaky-{seed}", fs, random.Random(seed), 300, 8)
    assert counts["ok"] > 50, counts
    assert counts["typed error"] > 10, counts


@pytest.mark.parametrize("kind", ["memory", "LocalFileSystem", "DirFileSystem"])
def test_random_retention_schedules_with_restarts(tmp_path, kind):
    if kind == "memory":
        root, fs = "/r3-retention", MemoryFileSystem(global_store=False, skip_instance_cache=True)
    else:
        _, root, fs = make_root(tmp_path, kind)
    totals = {"files": 0, "restarts": 0, "read": 0}
    for case in range(20):
        rng = random.Random(f"{kind}-{case}")
        case_root = f"{root}/case{case}"
        counts = retention_campaign(case_root, fs, rng, rng.randint(3, 9), rng.randint(0, 3), 0.3)
        totals = {k: totals[k] + counts[k] for k in totals}
    assert totals["restarts"] > 5, totals
    assert totals["read"] > 40, totals
