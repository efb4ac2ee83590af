"""A batch's read plan: one open per file however handles spell it, the largest files first, kept
files taken only by the job that reads them, and a FIFO refused without opening it."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from r3data.errors import PayloadHandleError
from r3data.payload import PayloadReader, PayloadRoot, PayloadWriter
from r3data.payload.reader import OpenFiles, RangeRead
from r3data.wire.segment import PayloadSegment

SHAPE = (48, 8)


def write_files(root: Path, rows: list[int]) -> tuple[list, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    writer = PayloadWriter(str(root))
    arrays = [rng.integers(0, 128, (n, *SHAPE), dtype=np.uint8) for n in rows]
    return [writer.write(1, {"routes": a})[0] for a in arrays], arrays


def ranges_of(segments: list) -> list[RangeRead]:
    return [
        RangeRead(s, s.offset, s.nbytes, memoryview(np.zeros(s.nbytes, np.uint8)), s.crc32c)
        for s in segments
    ]


def test_file_jobs_read_the_largest_file_first(tmp_path):
    segments, arrays = write_files(tmp_path / "payloads", [3, 40, 1, 12])
    reader = PayloadReader(str(tmp_path / "payloads"), workers=1)
    ranges = ranges_of(segments)
    jobs = reader.file_jobs(ranges)
    assert len(jobs) == 4
    jobs[0]()
    assert [r.done for r in ranges] == [0, segments[1].nbytes, 0, 0]
    for job in jobs[1:]:
        job()
    for r, a in zip(ranges, arrays, strict=True):
        np.testing.assert_array_equal(r.array(), a.reshape(-1))


def test_one_open_per_file_however_handles_spell_it(tmp_path):
    root = tmp_path / "payloads"
    (s,), (routes,) = write_files(root, [10])
    reader = PayloadReader(str(root), workers=1)
    opened: list[str] = []
    real_open = reader.root.open_name

    def counting_open(name: str, handle: str | None = None, root_fd: int | None = None):
        opened.append(name)
        return real_open(name, handle, root_fd)

    reader.root.open_name = counting_open  # type: ignore[method-assign]
    half = s.rows // 2
    first = replace(s, rows=half, crc32c=None)
    second = replace(  # the same file, named absolutely
        first, file=f"{root}/{s.file}", offset=s.offset + half * s.row_bytes, rows=s.rows - half
    )
    third = replace(first, file=s.file.replace("/", "/./"))
    out = np.zeros((s.rows + half, *SHAPE), np.uint8)
    reader.read_into([first, second, third], out)
    np.testing.assert_array_equal(out, np.concatenate([routes, routes[:half]]))
    assert opened == [s.file]


def test_a_kept_file_is_taken_only_by_the_job_that_reads_it(tmp_path):
    root = tmp_path / "payloads"
    segments, arrays = write_files(root, [5, 7])
    reader = PayloadReader(str(root), workers=1)
    kept = OpenFiles()
    handles = {s.file: reader.root.open_read(s.file) for s in segments}
    for name, handle in handles.items():
        assert kept.put(name, handle)
    ranges = ranges_of(segments)
    jobs = reader.file_jobs(ranges, kept)
    jobs[0]()  # the larger file: read through the kept descriptor, then closed
    assert handles[segments[1].file].fd is None
    np.testing.assert_array_equal(ranges[1].array(), arrays[1].reshape(-1))
    assert handles[segments[0].file].fd is not None  # its job has not run: still kept
    kept.close()  # a plan that stops early closes what no job took, once
    assert handles[segments[0].file].fd is None
    assert kept.take(segments[0].file) is None


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    """A writer blocked opening the FIFO would be let through by any open for reading: it must
    still be blocked after the reader refused the FIFO."""
    root = tmp_path / "payloads"
    (s,), _ = write_files(root, [4])
    fifo = root / "v1" / "pipe.bin"
    os.mkfifo(fifo)
    writer_opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # blocks until someone opens the FIFO to read
        writer_opened.set()
        os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    payload_root = PayloadRoot(str(root))
    with pytest.raises(PayloadHandleError, match=r"v1/pipe\.bin.* is a FIFO, not a regular file"):
        payload_root.open_read("v1/pipe.bin")
    reader = PayloadReader(str(root), retries=0)
    segment = replace(s, file="v1/pipe.bin")
    with pytest.raises(PayloadHandleError, match="is a FIFO"):
        reader.read_into([segment], np.zeros((4, *SHAPE), np.uint8))
    assert not writer_opened.wait(0.2)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # let the writer go
    try:
        assert writer_opened.wait(10)
    finally:
        os.close(fd)
    thread.join(10)


def test_a_device_node_is_refused_without_being_opened(tmp_path):
    root = tmp_path / "payloads"
    write_files(root, [4])
    node = root / "v1" / "tty.bin"
    try:  # /dev/tty: opening it without a controlling terminal fails; refusing it must not
        os.mknod(node, 0o600 | 0o020000, os.makedev(5, 0))
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    with pytest.raises(PayloadHandleError, match="is a character device, not a regular file"):
        PayloadRoot(str(root)).open_read("v1/tty.bin")


class _BucketFileSystem(MemoryFileSystem):
    """Paths named as an object store names them: no root marker, ``bucket/key`` is whole."""

    root_marker = ""
    protocol = ("bucketmem",)
    store: ClassVar[dict] = {}  # its own files, not memory://'s
    pseudo_dirs: ClassVar[list] = [""]


def test_a_handle_is_normalised_once_on_a_bucket_root():
    """On a bucket root ``bucket/run/bucket/run/x.bin`` names ``x.bin`` under ``run/bucket/run``
    (the root's own path spelled first); normalising that name again would read the root's
    ``x.bin``, another file."""
    fs = _BucketFileSystem()
    fs.pipe("/b/run/b/run/x.bin", b"inner" * 4)
    fs.pipe("/b/run/x.bin", b"outer" * 4)
    segment = PayloadSegment("bytes", "b/run/b/run/x.bin", 0, 0, 20, "uint8")
    reader = PayloadReader("b/run", fs=fs)
    assert bytes(reader.read([segment])["bytes"]) == b"inner" * 4
    with reader.root.open_read(segment.file) as f:
        assert f.url.endswith("/b/run/b/run/x.bin")
