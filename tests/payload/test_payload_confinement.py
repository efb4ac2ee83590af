"""Opening payload files safely: confinement on every local-backed filesystem class, even while
the tree changes; non-regular files refused before they are opened; each descriptor closed once.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from payload_campaigns import LOCAL_CLASSES, local_classes, moved

import r3data.payload.reader as reader_module
from r3data.cli import main
from r3data.errors import (
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
    PayloadWriteError,
)
from r3data.payload import (
    PayloadReader,
    PayloadRetention,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    inspect,
    verify,
)
from r3data.payload.reader import OpenFiles

ROUTES = np.arange(64 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(64, 48, 8)


def make_root(tmp_path: Path, kind: str) -> tuple[str, fsspec.AbstractFileSystem]:
    base = tmp_path / "base"
    base.mkdir(parents=True)
    return local_classes(base)[kind]()


def finishes(fn: Callable[[], object], seconds: float = 10.0) -> object:
    """``fn()``'s result or exception, failing the test if it has not returned in time (a hang
    in ``open()`` cannot be interrupted: the thread is left behind as a daemon)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds} s")
    return outcome[0]


def test_local_backed_is_decided_by_capability(tmp_path):
    for kind in LOCAL_CLASSES:
        root, fs = make_root(tmp_path / kind.replace("(", "_").replace(")", ""), kind)
        assert PayloadRoot(root, fs=fs).local_backed, kind
    assert not PayloadRoot("memory://r3-capability").local_backed
    over_memory = DirFileSystem("/r3-capability", MemoryFileSystem())
    assert not PayloadRoot("run", fs=over_memory).local_backed


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_symlinks_out_of_the_root_are_refused_on_every_local_backed_class(tmp_path, kind):
    root, fs = make_root(tmp_path, kind)
    s = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    base = tmp_path / "base" / "payloads"
    secret = tmp_path / "secret"
    (secret / "v1").mkdir(parents=True)
    (secret / s.file).write_bytes((base / s.file).read_bytes())
    (base / "v1" / "etc").symlink_to(secret)  # v1/etc -> a directory outside
    (base / "v1" / "out.bin").symlink_to(secret / s.file)
    (base / "v1" / "in.bin").symlink_to(base / s.file)
    reader = PayloadReader(root, fs=fs, retries=0)
    for handle in ("v1/out.bin", f"v1/etc/{s.file}"):
        with pytest.raises(PayloadHandleError, match=r"symlink .* outside the root"):
            reader.read([moved(s, handle)])
    np.testing.assert_array_equal(reader.read([moved(s, "v1/in.bin")])["routes"], ROUTES)
    (base / "v7").symlink_to(secret)
    with pytest.raises(PayloadWriteError, match="outside the root"):  # writers are confined too
        PayloadWriter(root, fs=fs).write(7, {"routes": ROUTES})
    assert sorted(p.name for p in secret.iterdir()) == ["v1"]


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk"])
@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_a_root_following_no_symlinks_refuses_even_those_inside(
    tmp_path, kind, openat2, monkeypatch
):
    import r3data.payload.fs as payload_fs

    monkeypatch.setattr(payload_fs, "_openat2_missing", not openat2)
    root, fs = make_root(tmp_path, kind)
    s = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    base = tmp_path / "base" / "payloads"
    (base / "v1" / "alias.bin").symlink_to(posixpath.basename(s.file))  # a second name
    (base / "v2").symlink_to("v1")  # a folder's second name
    (base / "v1" / "up").symlink_to("..")
    strict = PayloadReader(root, fs=fs, retries=0, follow_symlinks=False)
    np.testing.assert_array_equal(strict.read([s])["routes"], ROUTES)
    for handle in ("v1/alias.bin", s.file.replace("v1/", "v2/"), f"v1/up/{s.file}"):
        with pytest.raises(PayloadHandleError, match="leads through a symlink beneath the root"):
            strict.read([moved(s, handle)])
        with pytest.raises(PayloadHandleError, match="leads through a symlink"):
            strict.check_sizes([moved(s, handle)])
    following = PayloadReader(root, fs=fs, retries=0)  # the default follows those inside
    np.testing.assert_array_equal(following.read([moved(s, "v1/alias.bin")])["routes"], ROUTES)
    with pytest.raises(PayloadNotFoundError):  # a missing file is still just missing
        strict.read([moved(s, "v1/none.bin")])


@pytest.fixture
def other_namespace(tmp_path):
    """A process holding its own mount namespace, in which a tmpfs over ``tmp_path/payloads``
    holds ``v1/secret.bin`` and a folder ``v2``: here those paths name nothing."""
    root = tmp_path / "payloads"
    (root / "v0").mkdir(parents=True)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    script = (
        f"mount -t tmpfs none {root} && mkdir {root}/v1 {root}/v2 && "
        f"printf SECRET-OF-ANOTHER-NAMESPACE > {root}/v1/secret.bin && echo ready && exec sleep 60"
    )
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if holder.stdout.readline().strip() != "ready":
            pytest.skip("cannot make a mount namespace here (unshare -m needs privileges)")
        yield root, holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_symlink_into_another_mount_namespace_is_refused(other_namespace):
    # /proc/PID/root leads into another namespace, where the kernel shows the file's path as
    # that namespace sees it: inside the root's path, yet not a file of this root.
    root, pid = other_namespace
    assert not (root / "v1" / "secret.bin").exists()
    there = f"/proc/{pid}/root{root}"
    (root / "v0" / "absolute.bin").symlink_to(f"{there}/v1/secret.bin")
    (root / "v0" / "relative.bin").symlink_to("../" * len(root.parts) + f"{there}/v1/secret.bin")
    reader = PayloadReader(str(root), retries=0)
    for handle in ("v0/absolute.bin", "v0/relative.bin"):
        segment = PayloadSegment("routes", handle, 0, 0, 4, "uint8", (4,))
        with pytest.raises(PayloadHandleError, match="mount namespace"):
            reader.read([segment])
    (root / "v2").symlink_to(f"{there}/v2")
    with pytest.raises(PayloadWriteError, match="mount namespace"):  # nor is anything written there
        PayloadWriter(str(root)).write(2, {"routes": ROUTES})
    assert os.listdir(f"{there}/v2") == []


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_a_version_directory_swapped_for_a_symlink_is_refused_by_the_same_reader(tmp_path, kind):
    root, fs = make_root(tmp_path, kind)
    s = PayloadWriter(root, fs=fs).write(2, {"routes": ROUTES})[0]
    reader = PayloadReader(root, fs=fs, retries=0)
    np.testing.assert_array_equal(reader.read([s])["routes"], ROUTES)
    base = tmp_path / "base" / "payloads"
    outside = tmp_path / "outside"
    (base / "v2").rename(outside)  # the same bytes, now outside the root
    (base / "v2").symlink_to(outside)
    with pytest.raises(PayloadHandleError, match="outside the root"):
        reader.read([s])


def test_the_sizes_check_finds_the_root_by_its_path_on_every_call(tmp_path):
    """One root descriptor serves one call's opens (``PayloadRoot.held``), never the next: a
    root renamed away and replaced between calls is looked up again, its old tree not read."""
    root = tmp_path / "payloads"
    s = PayloadWriter(root).write(0, {"routes": ROUTES})[0]
    reader = PayloadReader(root, retries=0)
    kept = OpenFiles()
    reader.check_sizes([s], kept)
    kept.close()
    root.rename(tmp_path / "old")
    root.mkdir()  # the same path, another directory, without the file
    with pytest.raises(PayloadNotFoundError):
        reader.check_sizes([s], OpenFiles())
    (tmp_path / "old").rename(tmp_path / "gone")  # the old root moves again: still not read
    with pytest.raises(PayloadNotFoundError):
        reader.check_sizes([s], OpenFiles())


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_retention_never_deletes_through_a_symlink_out_of_the_root(tmp_path, kind):
    root, fs = make_root(tmp_path, kind)
    base = tmp_path / "base" / "payloads"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"not yours")
    base.mkdir()
    (base / "v0").symlink_to(outside)
    retention = PayloadRetention(root, 0, fs=fs, fresh=False)
    retention.claim(0, ["v0/keep.bin"])
    retention.on_policy_update(5)
    retention.close()
    assert (outside / "keep.bin").read_bytes() == b"not yours"
    assert retention.metrics().delete_errors == 1


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, kind):
    root, fs = make_root(tmp_path, kind)
    s = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    fifo = tmp_path / "base" / "payloads" / "v1" / "pipe.bin"
    os.mkfifo(fifo)
    reader = PayloadReader(root, fs=fs, retries=0)
    error = finishes(lambda: reader.read([moved(s, "v1/pipe.bin")]))
    assert isinstance(error, PayloadHandleError)
    assert "is a FIFO, not a regular file" in str(error)
    report = finishes(lambda: verify(root, fs=fs))
    assert report.unreadable.keys() == {"v1/pipe.bin"}
    assert report.files_checked == 1
    assert not report.ok
    error = finishes(lambda: inspect(fifo))
    assert isinstance(error, PayloadHandleError)


def test_devices_and_directories_are_refused_too(tmp_path):
    root = tmp_path / "payloads"
    s = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    (root / "v1" / "dir.bin").mkdir()
    reader = PayloadReader(str(root), retries=0)
    with pytest.raises(PayloadHandleError, match="is a directory"):
        reader.read([moved(s, "v1/dir.bin")])
    try:
        os.mknod(root / "v1" / "zero.bin", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    with pytest.raises(PayloadHandleError, match="is a character device"):
        reader.read([moved(s, "v1/zero.bin")])
    (root / "v1" / "loop.bin").symlink_to("loop.bin")
    with pytest.raises(PayloadHandleError, match="loops through symlinks"):
        reader.read([moved(s, "v1/loop.bin")])


def test_cli_inspect_and_verify_never_block_on_a_fifo(tmp_path, capsys):
    root = tmp_path / "payloads"
    PayloadWriter(str(root)).write(1, {"routes": ROUTES})
    os.mkfifo(root / "v1" / "pipe.bin")
    assert finishes(lambda: main(["inspect", str(root / "v1" / "pipe.bin")])) == 2
    assert "pipe.bin is a FIFO, not a regular file" in capsys.readouterr().err
    assert finishes(lambda: main(["verify", str(root)])) == 1
    out = capsys.readouterr().out
    assert "1 payload file checked" in out
    assert "unreadable v1/pipe.bin: " in out
    assert "1 unreadable file" in out


def test_verify_lists_a_symlink_out_of_the_root_as_a_problem(tmp_path):
    root = tmp_path / "payloads"
    s = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    (tmp_path / "outside.bin").write_bytes((root / s.file).read_bytes())
    (root / "v1" / "out.bin").symlink_to(tmp_path / "outside.bin")
    report = verify(root)
    assert list(report.unreadable) == ["v1/out.bin"]
    assert "outside the root" in report.unreadable["v1/out.bin"]
    assert (report.files_checked, report.corrupt) == (1, {})


def test_verify_counts_corrupt_files_and_names_each_once(tmp_path, capsys):
    root = tmp_path / "payloads"
    writer = PayloadWriter(str(root))
    good, bad = (writer.write(1, {"routes": ROUTES})[0] for _ in range(2))
    data = bytearray((root / bad.file).read_bytes())
    data[bad.offset] ^= 0xFF
    (root / bad.file).write_bytes(bytes(data))
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "2 payload files checked" in out
    (line,) = [line for line in out.splitlines() if line.startswith("  corrupt ")]
    assert line.count(bad.file) == 1
    assert good.file not in out


def test_a_failed_read_closes_each_descriptor_exactly_once(tmp_path, monkeypatch):
    """A truncated file read for its second field: the reader gives up on it, and must not close
    its descriptor a second time, which by then may be another file's (here: the test's)."""
    root = tmp_path / "payloads"
    routes, other = PayloadWriter(str(root)).write(1, {"a": ROUTES, "b": ROUTES})
    path = root / routes.file
    path.write_bytes(path.read_bytes()[: other.offset + 10])
    with pytest.raises(PayloadReadError, match="short read"):
        PayloadReader(str(root), retries=0).read([routes, other])

    held: dict[str, int] = {}

    def hold_a_descriptor(seconds: float, stop: object) -> None:  # the backoff: the freed number
        held["fd"] = os.open(tmp_path / "bystander", os.O_RDWR | os.O_CREAT)

    monkeypatch.setattr(reader_module, "_pause", hold_a_descriptor)
    reader = PayloadReader(str(root), workers=1, retries=1)
    with pytest.raises(PayloadReadError, match="short read"):
        reader.read([routes, other])
    os.fstat(held["fd"])  # still open
    assert os.path.samestat(os.fstat(held["fd"]), os.stat(tmp_path / "bystander"))
    os.close(held["fd"])


def test_open_read_gives_size_descriptor_and_reads_at_offsets(tmp_path):
    root = PayloadRoot(tmp_path / "payloads")
    s = PayloadWriter(root.url).write(1, {"routes": ROUTES})[0]
    memory = PayloadRoot(f"memory://r3-open-read-{os.getpid()}-{time.monotonic_ns()}")
    m = PayloadWriter(memory.url).write(1, {"routes": ROUTES})[0]
    for payload_root, segment, local in ((root, s, True), (memory, m, False)):
        with payload_root.open_read(segment.file) as f:
            assert (f.fd is not None) == local
            assert f.size == segment.offset + segment.nbytes
            assert f.url.endswith(segment.file)
            dest = bytearray(100)
            assert f.read_at(segment.offset + 384, memoryview(dest)) == 100
            assert bytes(dest) == ROUTES.tobytes()[384:484]
            assert f.read_at(f.size - 10, memoryview(dest)) == 10
            assert f.read_at(f.size, memoryview(dest)) == 0
        f.close()  # a second close does nothing
        assert f.fd is None


def test_object_store_handles_may_name_the_bucket(tmp_path):
    """``bucket/key`` and ``s3://bucket/key`` are whole paths on an object store: the root is not
    prefixed twice; a relative handle stays relative; another bucket or prefix is refused."""
    pytest.importorskip("s3fs")
    root = PayloadRoot("s3://bucket/run", fs=fsspec.filesystem("s3", anon=True))
    assert root.relative("bucket/run/v1/x.bin") == "v1/x.bin"
    assert root.relative("s3://bucket/run/v1/x.bin") == "v1/x.bin"
    assert root.relative("v1/x.bin") == "v1/x.bin"
    assert root.full("bucket/run/v1/x.bin") == "bucket/run/v1/x.bin"
    for outside in ("s3://bucket/other/x.bin", "s3://other/run/v1/x.bin", "/bucket/other/x"):
        with pytest.raises(PayloadHandleError, match="outside the root"):
            root.relative(outside)


def test_fresh_run_keeps_what_a_writer_published_first(tmp_path):
    root = tmp_path / "payloads"
    writer = PayloadWriter(str(root))
    old = [writer.write(v, {"routes": ROUTES})[0].file for v in (0, 3)]
    hour_ago = time.time() - 3600
    for name in old:
        os.utime(root / name, (hour_ago, hour_ago))
    published_first = writer.write(0, {"routes": ROUTES})[0].file  # this run, before retention
    PayloadRetention(str(root), 2, fresh=True).close()
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.bin")) == [published_first]


class DeniedDeletes(MemoryFileSystem):
    cachable = False

    def rm_file(self, path):
        raise PermissionError(13, "Permission denied", path)

    def makedirs(self, path, exist_ok=False):
        if "readonly" in path:
            raise PermissionError(13, "Permission denied", path)
        super().makedirs(path, exist_ok=exist_ok)


def test_fresh_run_reports_permission_errors_as_payload_errors():
    fs = DeniedDeletes(global_store=False)
    PayloadWriter("/r3-denied", fs=fs).write(0, {"routes": ROUTES})
    with pytest.raises(PayloadPermissionError, match=r"1 payload files .* may not be deleted"):
        PayloadRetention("/r3-denied", 2, fs=fs, fresh=True, run_started=time.time() + 10)
    with pytest.raises(PayloadPermissionError, match="may not be created"):
        PayloadRetention("/r3-readonly", 2, fs=fs, fresh=False)
