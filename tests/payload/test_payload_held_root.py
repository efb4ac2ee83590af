"""One root descriptor per plan (``PayloadRoot.held``) and the one-``preadv`` read of a kept or
first-opened file, attacked: the tree changed between a plan's steps (hooked, not raced), files
cut or grown between the size check and the read, checksum mismatches, open counts, descriptor
counts on every error path, and destinations larger than their ranges."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from payload_campaigns import moved

import r3data.payload.reader as reader_module
from r3data.errors import (
    PayloadChecksumError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadReadError,
    SegmentError,
)
from r3data.payload import PayloadReader, PayloadRoot, PayloadWriter
from r3data.payload.reader import OpenFiles, RangeRead

SHAPE = (48, 8)


def two_files(root: Path) -> tuple[list, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    writer = PayloadWriter(str(root))
    arrays = [rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8) for n in (6, 4)]
    return [writer.write(1, {"routes": a})[0] for a in arrays], arrays


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def hook_opens(reader: PayloadReader, after_first=None) -> list[tuple[str, int | None]]:
    """Record each ``open_name`` (name, root descriptor) of ``reader``'s root; run
    ``after_first()`` once the first open returned (the tree changes between two steps)."""
    calls: list[tuple[str, int | None]] = []
    real = reader.root.open_name

    def open_name(name, handle=None, root_fd=None):
        calls.append((name, root_fd))
        try:
            return real(name, handle, root_fd)
        finally:
            if len(calls) == 1 and after_first is not None:
                after_first()

    reader.root.open_name = open_name  # type: ignore[method-assign]
    return calls


def unchecked(s):
    return replace(s, crc32c=None)  # bytes from anywhere would pass: only the bytes tell


def test_a_root_renamed_away_and_linked_elsewhere_mid_plan_reads_the_old_root_only(tmp_path):
    """The root is renamed and its path made a link to another tree between the plan's first and
    second open: the plan reads the directory that was the root when it began (held), whose
    files the writer published; the next plan finds the root by its path."""
    root, elsewhere = tmp_path / "payloads", tmp_path / "elsewhere"
    segments, arrays = two_files(root)
    (elsewhere / "v1").mkdir(parents=True)
    for s in segments:
        (elsewhere / s.file).write_bytes(bytes(b ^ 0x5A for b in (root / s.file).read_bytes()))

    def swap() -> None:
        root.rename(tmp_path / "old")
        root.symlink_to(elsewhere)

    reader = PayloadReader(str(root), workers=1, retries=0)
    calls = hook_opens(reader, swap)
    outs = [np.zeros_like(a) for a in arrays]
    reader.read_many([([unchecked(s)], out) for s, out in zip(segments, outs, strict=True)])
    for out, a in zip(outs, arrays, strict=True):
        np.testing.assert_array_equal(out, a)
    assert len(calls) == 2
    assert calls[0][1] is not None
    assert calls[0][1] == calls[1][1]  # one descriptor, the old root's
    out = np.zeros_like(arrays[0])
    reader.read_into([unchecked(segments[0])], out)  # a later plan: the root is what its path is
    np.testing.assert_array_equal(out, arrays[0] ^ 0x5A)


@pytest.mark.parametrize("openat2", [True, False])
def test_the_held_root_moved_away_confines_to_itself_not_to_its_path(
    tmp_path, openat2, monkeypatch
):
    """Held, the old root is still the confinement: once it is moved, a link in it to a file
    outside it (the new root's path, a secret) is refused, a link to itself is read; judged by
    the kernel (openat2) and by the descriptor's own path (kernels without it)."""
    import r3data.payload.fs as payload_fs

    monkeypatch.setattr(payload_fs, "_openat2_missing", not openat2)
    root, old = tmp_path / "payloads", tmp_path / "old"
    segments, arrays = two_files(root)
    secret = tmp_path / "secret.bin"  # the plan reads the larger file first, then this one
    secret.write_bytes((root / segments[1].file).read_bytes())
    name = os.path.basename(segments[1].file)
    fresh = tmp_path / "fresh"
    (fresh / "v1").mkdir(parents=True)
    (fresh / "v1" / name).write_bytes(secret.read_bytes())

    def move() -> None:
        root.rename(old)
        (old / "v1" / "secret.bin").symlink_to(secret)
        (old / "v1" / "new.bin").symlink_to(root / "v1" / name)  # the root's path, now fresh
        (old / "v1" / "self.bin").symlink_to(old / segments[1].file)
        root.symlink_to(fresh)

    for handle, refused in (
        ("v1/secret.bin", True),
        ("v1/new.bin", True),
        ("v1/self.bin", False),
    ):
        if old.exists():
            for link in ("secret.bin", "new.bin", "self.bin"):
                (old / "v1" / link).unlink()
            root.unlink()
            old.rename(root)
        reader = PayloadReader(str(root), workers=1, retries=0)
        calls = hook_opens(reader, move)
        plan = [([unchecked(segments[0])], np.zeros_like(arrays[0]))]
        plan.append(([unchecked(moved(segments[1], handle))], np.zeros_like(arrays[1])))
        if refused:
            with pytest.raises(PayloadHandleError, match="outside the root"):
                reader.read_many(plan)
        else:
            reader.read_many(plan)
            np.testing.assert_array_equal(plan[1][1], arrays[1])
        assert calls[1] == (handle, calls[0][1])


def test_a_file_cut_between_the_check_and_a_kept_read_is_the_slow_paths_short_read(tmp_path):
    """Kept from the check, then cut: the one-preadv read comes up short and the general path
    gives the message it always gave (attempts, bytes got, the size found), no descriptor kept."""
    root = tmp_path / "payloads"
    (s, _), _ = two_files(root)
    reader = PayloadReader(str(root), workers=1, retries=1, backoff=0.0, max_backoff=0.0)
    before = open_fds()
    kept = OpenFiles()
    reader.check_sizes([s], kept)
    os.truncate(root / s.file, s.offset + 1000)
    (r,) = ranges = [RangeRead(s, s.offset, s.nbytes, memoryview(bytearray(s.nbytes)), s.crc32c)]
    (job,) = reader.file_jobs(ranges, kept)
    url = reader.root.url_of(s.file)
    message = (
        f"short read of {url}: wanted {s.nbytes} bytes at offset {s.offset}, got 1000 after 2 "
        f"attempts (file size {s.offset + 1000}; field 'routes' rows [0, 6))"
    )
    with pytest.raises(PayloadReadError) as caught:
        job()
    assert str(caught.value) == message
    assert caught.value.r3data_range is r
    kept.close()
    assert open_fds() == before


def test_a_file_cut_then_written_back_during_the_backoff_reads_exactly(tmp_path, monkeypatch):
    """Cut after the check, whole again by the retry: the bytes and their checksum are the
    file's (nothing the short first read left counts twice)."""
    root = tmp_path / "payloads"
    (s, _), (a, _) = two_files(root)
    path = root / s.file
    whole = path.read_bytes()
    monkeypatch.setattr(reader_module, "_pause", lambda *_: path.write_bytes(whole))  # backoff
    reader = PayloadReader(str(root), workers=1, retries=1)
    kept = OpenFiles()
    reader.check_sizes([s], kept)
    with open(path, "r+b") as f:
        f.truncate(s.offset + 1000)
    out = np.zeros_like(a)
    for job in reader.file_jobs(_into(s, out), kept):
        job()
    np.testing.assert_array_equal(out, a)


def _into(s, out: np.ndarray) -> list[RangeRead]:
    return [RangeRead(s, s.offset, s.nbytes, memoryview(out.reshape(-1).view(np.uint8)), s.crc32c)]


def test_a_file_grown_after_the_check_reads_its_range(tmp_path):
    root = tmp_path / "payloads"
    (s, _), (a, _) = two_files(root)
    reader = PayloadReader(str(root), workers=1, retries=0)
    kept = OpenFiles()
    reader.check_sizes([s], kept)
    with open(root / s.file, "ab") as f:
        f.write(b"\xff" * 4096)
    out = np.zeros_like(a)
    for job in reader.file_jobs(_into(s, out), kept):
        job()
    np.testing.assert_array_equal(out, a)


def test_a_checksum_mismatch_reads_the_same_on_every_path(tmp_path):
    """One-preadv (read_into, kept or first opened) and general (read, which allocates) paths:
    the same class and message, naming the file."""
    root = tmp_path / "payloads"
    (s, _), (a, _) = two_files(root)
    data = bytearray((root / s.file).read_bytes())
    data[s.offset + 7] ^= 1
    (root / s.file).write_bytes(bytes(data))
    reader = PayloadReader(str(root), workers=1, retries=0)
    before = open_fds()
    messages = set()
    with pytest.raises(PayloadChecksumError) as caught:
        reader.read([s])
    messages.add(str(caught.value))
    with pytest.raises(PayloadChecksumError) as caught:
        reader.read_into([s], np.zeros_like(a))
    messages.add(str(caught.value))
    kept = OpenFiles()
    reader.check_sizes([s], kept)
    (job,) = reader.file_jobs(_into(s, np.zeros_like(a)), kept)
    with pytest.raises(PayloadChecksumError) as caught:
        job()
    kept.close()
    messages.add(str(caught.value))
    (message,) = messages
    assert message.startswith(f"checksum mismatch in {root / s.file}: field 'routes' rows [0, 6)")
    assert open_fds() == before


@pytest.mark.parametrize("retries", [0, 2])
def test_a_missing_file_is_opened_once_per_attempt(tmp_path, retries):
    """'tried N times' is what happened: the first open, beneath the plan's root descriptor, is
    the first attempt, not one more before them."""
    root = tmp_path / "payloads"
    (s, _), (a, _) = two_files(root)
    gone = moved(s, "v1/gone.bin")
    reader = PayloadReader(str(root), workers=1, retries=retries, backoff=0.0, max_backoff=0.0)
    calls = hook_opens(reader)
    tried = rf"does not exist \(tried {retries + 1} times\)"
    with pytest.raises(PayloadNotFoundError, match=tried):
        reader.read_into([gone], np.zeros_like(a))
    assert len(calls) == retries + 1
    calls.clear()
    with pytest.raises(PayloadNotFoundError, match=tried):
        reader.check_sizes([gone])
    assert len(calls) == retries + 1
    assert calls[0][1] is not None  # the first beneath the held root, the others by path
    assert all(fd is None for _, fd in calls[1:])


@pytest.mark.parametrize("retries", [0, 2])
def test_a_short_file_is_looked_at_once_per_attempt(tmp_path, retries):
    root = tmp_path / "payloads"
    (s, _), _ = two_files(root)
    os.truncate(root / s.file, s.offset + 10)
    reader = PayloadReader(str(root), workers=1, retries=retries, backoff=0.0, max_backoff=0.0)
    calls = hook_opens(reader)
    with pytest.raises(SegmentError, match=rf"looked {retries + 1} times"):
        reader.check_sizes([s], OpenFiles())
    assert len(calls) == retries + 1


def test_ranges_of_one_refused_file_name_the_first_in_the_file_on_every_path(tmp_path):
    """A file refused at its open (a directory here) fails every range of it; the range named is
    the first in file order whether the plan opened it beneath its root descriptor (read_ranges)
    or not (file_jobs)."""
    root = tmp_path / "payloads"
    (s, _), _ = two_files(root)
    (root / "v1" / "dir.bin").mkdir()
    half = s.rows // 2
    low = replace(s, file="v1/dir.bin", rows=half, crc32c=None)
    high = replace(low, offset=s.offset + half * s.row_bytes, pos=half)
    reader = PayloadReader(str(root), workers=1, retries=0)
    for run in (reader.read_ranges, lambda rs: [job() for job in reader.file_jobs(rs)]):
        ranges = [
            RangeRead(x, x.offset, x.nbytes, memoryview(bytearray(x.nbytes))) for x in (high, low)
        ]
        with pytest.raises(PayloadHandleError, match="is a directory") as caught:
            run(ranges)
        assert caught.value.r3data_range is ranges[1]


def test_a_destination_larger_than_its_range_gets_the_range_only(tmp_path):
    """``dest`` past ``nbytes`` is the caller's (another range's, say): never written, nor
    counted into the checksum (the range here ends the file)."""
    root = tmp_path / "payloads"
    (_, s), (_, b) = two_files(root)
    assert (root / s.file).stat().st_size == s.offset + s.nbytes
    buffer = bytearray(b"\xee" * (s.nbytes + 64))
    r = RangeRead(s, s.offset, s.nbytes, memoryview(buffer), s.crc32c)
    PayloadReader(str(root), workers=1, retries=0).read_ranges([r])
    assert bytes(buffer[: s.nbytes]) == b.tobytes()
    assert bytes(buffer[s.nbytes :]) == b"\xee" * 64
    shorter = replace(s, rows=s.rows - 1, crc32c=None)  # the file goes on past the range
    buffer[:] = b"\xee" * len(buffer)
    r = RangeRead(shorter, shorter.offset, shorter.nbytes, memoryview(buffer))
    PayloadReader(str(root), workers=1, retries=0).read_ranges([r])
    assert bytes(buffer[shorter.nbytes :]) == b"\xee" * (len(buffer) - shorter.nbytes)


def _fifo(root: Path, s) -> object:
    os.mkfifo(root / "v1" / "pipe.bin")
    return moved(s, "v1/pipe.bin")


def _outside(root: Path, s) -> object:
    (root.parent / "secret.bin").write_bytes((root / s.file).read_bytes())
    (root / "v1" / "out.bin").symlink_to(root.parent / "secret.bin")
    return moved(s, "v1/out.bin")


def _short(root: Path, s) -> object:
    os.truncate(root / s.file, s.offset + 100)
    return s


def _corrupt(root: Path, s) -> object:
    data = bytearray((root / s.file).read_bytes())
    data[-1] ^= 1
    (root / s.file).write_bytes(bytes(data))
    return s


BROKEN = {
    "missing": lambda root, s: moved(s, "v1/gone.bin"),
    "directory": lambda root, s: (root / "v1" / "d.bin").mkdir() or moved(s, "v1/d.bin"),
    "fifo": _fifo,
    "outside": _outside,
    "short": _short,
    "corrupt": _corrupt,
}


@pytest.mark.parametrize("broken", BROKEN)
def test_no_descriptor_outlives_a_failed_plan_on_any_path(tmp_path, broken):
    """Every entry point (sizes check, kept or not; read_ranges; read, which allocates), with
    the root present or gone: the descriptors open afterwards are the ones open before."""
    root = tmp_path / "payloads"
    (s, good), _ = two_files(root)
    bad = BROKEN[broken](root, s)
    reader = PayloadReader(str(root), workers=2, retries=1, backoff=0.0, max_backoff=0.0)
    ranges = lambda: [  # noqa: E731
        RangeRead(x, x.offset, x.nbytes, memoryview(bytearray(x.nbytes)), x.crc32c)
        for x in (good, bad)
    ]
    before = open_fds()
    for kept in (None, OpenFiles(), OpenFiles(budget=1)):
        try:
            reader.check_sizes([good, bad], kept)
            if kept is not None:
                for job in reader.file_jobs(ranges(), kept):
                    job()
        except (PayloadReadError, PayloadHandleError, SegmentError):
            pass
        finally:
            if kept is not None:
                kept.close()
    for read in (lambda: reader.read_ranges(ranges()), lambda: reader.read([good, bad])):
        with pytest.raises((PayloadReadError, PayloadHandleError, SegmentError)):
            read()
    assert open_fds() == before
    root.rename(tmp_path / "gone")  # no root: held() has nothing to hold
    with pytest.raises(PayloadNotFoundError):
        reader.read_ranges(ranges())
    with pytest.raises(PayloadNotFoundError):
        reader.check_sizes([good, bad])
    assert open_fds() == before


@pytest.mark.parametrize("kind", ["memory", "DirFileSystem(memory)"])
def test_a_root_no_kernel_confines_holds_no_descriptor_and_reads_by_fsspec(kind):
    """No descriptor, so no one-preadv read: an object store's files are read by ranged reads,
    checksummed all the same."""
    store = MemoryFileSystem(global_store=False, skip_instance_cache=True)
    root, fs = ("/r3-held", store) if kind == "memory" else ("run", DirFileSystem("/r3-dir", store))
    payload_root = PayloadRoot(root, fs)
    with payload_root.held() as fd:
        assert fd is None
    a = np.arange(4 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(4, *SHAPE)
    (s,) = PayloadWriter(root, fs=fs).write(1, {"routes": a})
    out = np.zeros_like(a)
    PayloadReader(root, fs=fs, retries=0).read_into([s], out)
    np.testing.assert_array_equal(out, a)
    path = payload_root.full(s.file)
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(PayloadChecksumError, match=r"checksum mismatch in (memory|dir)://"):
        PayloadReader(root, fs=fs, retries=0).read_into([s], out)
