"""What goes wrong with payload files, and what each failure raises."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from r3data.errors import (
    ConfigError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
    PayloadWriteError,
    SegmentError,
)
from r3data.payload import PayloadReader, PayloadRetention, PayloadSegment, PayloadWriter

REPO = Path(__file__).resolve().parents[2]
ROUTES = np.arange(10 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(10, 48, 8)


def write_routes(root: str, fs=None) -> PayloadSegment:
    return PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]


def moved(segment: PayloadSegment, file: str) -> PayloadSegment:
    return PayloadSegment(**{**segment.to_dict(), "file": file})


# --- handles that escape the root ----------------------------------------------------------


@pytest.mark.parametrize(
    "handle",
    ["../outside.bin", "v1/../../outside.bin", "/etc/passwd", "..", ".", "file:///etc/passwd"],
)
def test_handles_escaping_the_root_are_refused(payload_root, handle):
    s = write_routes(payload_root)
    reader = PayloadReader(payload_root)
    if handle == "file:///etc/passwd" and payload_root.startswith("/"):
        handle = "memory://etc/passwd"  # a protocol other than the root's
    with pytest.raises(PayloadHandleError, match="root"):
        reader.read([moved(s, handle)])
    with pytest.raises(PayloadHandleError):
        PayloadRetention(payload_root, 2, fresh=False).claim(0, [handle])


def test_absolute_path_in_a_sibling_directory_is_refused(tmp_path):
    root = tmp_path / "payloads"
    s = write_routes(str(root))
    sibling = tmp_path / "payloads-other" / s.file
    sibling.parent.mkdir(parents=True)
    sibling.write_bytes((root / s.file).read_bytes())
    with pytest.raises(PayloadHandleError, match="outside the root"):
        PayloadReader(str(root)).read([moved(s, str(sibling))])


def test_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "payloads"
    s = write_routes(str(root))
    secret = tmp_path / "secret.bin"
    secret.write_bytes((root / s.file).read_bytes())
    (root / "v1" / "link.bin").symlink_to(secret)
    (root / "v1" / "inside.bin").symlink_to(root / s.file)
    reader = PayloadReader(str(root))
    with pytest.raises(PayloadHandleError, match="symlink"):
        reader.read([moved(s, "v1/link.bin")])
    np.testing.assert_array_equal(reader.read([moved(s, "v1/inside.bin")])["routes"], ROUTES)


def test_renames_elsewhere_never_turn_a_symlink_through_dotdot_into_a_read_error(tmp_path):
    """``openat2(RESOLVE_BENEATH)`` fails with EAGAIN when a rename anywhere on the machine races
    a ``..`` it resolves (14% of these opens while another process renames): the symlink is
    still judged, out of the root refused, inside read."""
    root = tmp_path / "payloads"
    s = write_routes(str(root))
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes((root / s.file).read_bytes())
    (root / "v1" / "out.bin").symlink_to(Path("../..") / "outside" / "secret.bin")
    (root / "v2").mkdir()
    (root / "v2" / "up.bin").symlink_to(Path("..") / s.file)
    reader = PayloadReader(str(root), retries=0)
    renamer = run_python(RENAMER, str(tmp_path / "a"), str(tmp_path / "b"))
    try:
        assert read_line(renamer, timeout=60) == "renaming\n"
        for _ in range(300):
            with pytest.raises(PayloadHandleError, match="outside the root"):
                reader.read([moved(s, "v1/out.bin")])
            np.testing.assert_array_equal(reader.read([moved(s, "v2/up.bin")])["routes"], ROUTES)
    finally:
        renamer.kill()
        renamer.communicate()


# --- missing, truncated, unreadable ---------------------------------------------------------


def test_missing_file_is_retried_then_reported(payload_root):
    s = write_routes(payload_root)
    reader = PayloadReader(payload_root, retries=2, backoff=0.001)
    with pytest.raises(
        PayloadNotFoundError, match=r"v1/gone\.bin does not exist \(tried 3 times\)"
    ) as info:
        reader.read([moved(s, "v1/gone.bin")])
    assert isinstance(info.value, FileNotFoundError)


def test_truncated_file_reports_the_exact_byte_counts(payload_root):
    s = write_routes(payload_root)
    fs, path = fsspec.core.url_to_fs(payload_root)
    data = fs.cat_file(f"{path}/{s.file}")
    keep = s.offset + 1000
    fs.pipe_file(f"{path}/{s.file}", data[:keep])
    reader = PayloadReader(payload_root, retries=1, backoff=0.001)
    pattern = rf"wanted {s.nbytes} bytes at offset {s.offset}, got 1000 after 2 attempts"
    with pytest.raises(PayloadReadError, match=pattern):
        reader.read_into([s], np.empty_like(ROUTES))
    # read() allocates only after the file proved large enough: nothing was read
    with pytest.raises(PayloadReadError, match=rf"got 0 after 2 attempts \(file size {keep}"):
        reader.read([s])


class TruncatedView(io.RawIOBase):
    """A real open file that shows only its first ``visible`` bytes (a stale NFS view)."""

    def __init__(self, f, visible: int) -> None:
        self.f, self.visible, self.at = f, visible, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = {0: 0, 1: self.at, 2: self.visible}[whence] + offset
        return self.at

    def readinto(self, buffer) -> int:
        self.f.seek(self.at)
        data = self.f.read(max(0, min(len(buffer), self.visible - self.at)))
        buffer[: len(data)] = data
        self.at += len(data)
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def short_reads(base: type) -> type:
    class ShortReads(base):
        """The first ``short_opens`` opens to read see the file cut at ``visible`` bytes."""

        def __init__(self, short_opens: int, visible: int = 0, **kwargs) -> None:
            super().__init__(skip_instance_cache=True, **kwargs)
            self.short_opens, self.visible, self.opens = short_opens, visible, 0

        def _open(self, path, mode="rb", **kwargs):
            f = super()._open(path, mode, **kwargs)
            if "r" not in mode:
                return f
            self.opens += 1
            return TruncatedView(f, self.visible) if self.opens <= self.short_opens else f

    return ShortReads


PRIVATE_STORE = {LocalFileSystem: {}, MemoryFileSystem: {"global_store": False}}


# a LocalFileSystem subclass is local-backed: its reads go through the kernel, not `_open`
@pytest.mark.parametrize("base", [MemoryFileSystem])
@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 7])
def test_short_reads_k_times_with_four_retries(tmp_path, base, k):
    root = str(tmp_path) if base is LocalFileSystem else "/r3test-short"
    fs = short_reads(base)(short_opens=k, **PRIVATE_STORE[base])
    s = write_routes(root, fs=fs)
    assert fs.opens == 0  # writing opened nothing to read
    fs.visible = s.offset + 2000
    reader = PayloadReader(root, fs=fs, retries=4, backoff=0.001, max_backoff=0.002)
    out = np.zeros_like(ROUTES)
    if k <= 4:
        reader.read_into([s], out)
        np.testing.assert_array_equal(out, ROUTES)
        assert fs.opens == k + 1
    else:
        pattern = rf"short read of .*{s.file}: wanted {s.nbytes} bytes at offset {s.offset}, got 2000 after 5 attempts"
        with pytest.raises(PayloadReadError, match=pattern):
            reader.read_into([s], out)
        assert fs.opens == 5


def test_backoff_doubles_up_to_its_cap():
    root = "/r3test-backoff"
    fs = short_reads(MemoryFileSystem)(short_opens=10, visible=0, global_store=False)
    s = write_routes(root, fs=fs)
    reader = PayloadReader(root, fs=fs, retries=4, backoff=0.02, max_backoff=0.04)
    start = time.perf_counter()
    with pytest.raises(PayloadReadError, match="after 5 attempts"):
        reader.read([s])
    assert time.perf_counter() - start >= 0.02 + 0.04 * 3


class DeniedFS(MemoryFileSystem):
    """A private memory:// store whose files may be written but not opened to read."""

    def __init__(self) -> None:
        super().__init__(global_store=False, skip_instance_cache=True)
        self.opens = 0

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        self.opens += 1
        raise PermissionError(13, "Permission denied", path)


def test_permission_denied_is_distinct_and_not_retried():
    root = "/r3test-denied"
    fs = DeniedFS()
    s = write_routes(root, fs=fs)
    assert fs.exists(f"{root}/{s.file}")
    with pytest.raises(PayloadPermissionError, match=rf"{s.file} may not be read") as info:
        PayloadReader(root, fs=fs).read([s])
    assert isinstance(info.value, PermissionError)
    assert fs.opens == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_local_file(tmp_path):
    s = write_routes(str(tmp_path))
    (tmp_path / s.file).chmod(0)
    with pytest.raises(PayloadPermissionError):
        PayloadReader(str(tmp_path)).read([s])


def test_reader_arguments_are_checked(tmp_path):
    for kwargs in ({"workers": 0}, {"retries": -1}, {"backoff": 1.0, "max_backoff": 0.5}):
        with pytest.raises(ConfigError):
            PayloadReader(str(tmp_path), **kwargs)


# --- writing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "fields", "pos", "message"),
    [
        (-1, {"routes": ROUTES}, 0, r"version: expected an int in \[0, 9223372036854775807\]"),
        (1, {}, 0, "non-empty mapping"),
        (1, {"routes": ROUTES, "mask": [np.arange(2)]}, {"routes": 0}, "pos must give .* 'mask'"),
        (1, {"mask": (np.arange(3), np.array([1, 1]))}, 0, "sum to 2, values hold 3"),
        (1, {"mask": (np.arange(3), np.array([4, -1]))}, 0, "row_lengths must be >= 0"),
        (1, {"mask": [np.arange(2), np.arange(2.0)]}, 0, "share one dtype"),
        (1, {"routes": np.array(3)}, 0, "at least 1-D"),
        (1, {"routes": np.array(["a"])}, 0, "dtype"),
    ],
)
def test_bad_fields_are_refused_before_writing(payload_root, version, fields, pos, message):
    with pytest.raises(SegmentError, match=message):
        PayloadWriter(payload_root).write(version, fields, pos=pos)
    fs, path = fsspec.core.url_to_fs(payload_root)
    assert not fs.exists(path) or fs.find(path) == []


RENAMER = """
import os, sys
a, b = sys.argv[1:]
open(a, "w").close()
print("renaming", flush=True)
while True:
    os.rename(a, b)
    os.rename(b, a)
"""

STALLED_WRITER = """
import os, sys, time
import numpy as np
from r3data.payload import PayloadWriter

real_write = os.write
def write_then_stall(fd, data):  # one real write, then hang so the kill lands mid-file
    written = real_write(fd, memoryview(data)[: 1 << 20])
    print("half", flush=True)
    time.sleep(60)
    return written
os.write = write_then_stall
PayloadWriter(sys.argv[1]).write(1, {"routes": np.ones((1 << 16, 48, 8), np.uint8)})
print("published", flush=True)
"""


def run_python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def read_line(child: subprocess.Popen, timeout: float) -> str:
    """The child's next line of output; "" when it printed none within ``timeout`` seconds."""
    readable, _, _ = select.select([child.stdout], [], [], timeout)
    return child.stdout.readline() if readable else ""


def test_writer_killed_mid_write_leaves_no_visible_file(tmp_path):
    child = run_python(STALLED_WRITER, str(tmp_path))
    try:
        line = read_line(child, timeout=60)
        if line != "half\n":
            child.kill()
            pytest.fail(f"the writer printed {line!r}, not 'half': {child.stderr.read()}")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    names = os.listdir(tmp_path / "v1")  # the writer is dead: the listing is final
    assert [n for n in names if n.endswith(".bin")] == []  # nothing under a final name
    (temp,) = names  # only the temporary
    assert temp.startswith(".")
    assert temp.endswith(".bin.tmp")
    assert 0 < (tmp_path / "v1" / temp).stat().st_size < 24 << 20


FULL_DISK_WRITER = """
import resource, signal, sys
import numpy as np
from r3data.errors import PayloadWriteError
from r3data.payload import PayloadWriter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    PayloadWriter(sys.argv[1]).write(1, {"routes": np.ones((8192, 48, 8), np.uint8)})
except PayloadWriteError as exc:
    print("PayloadWriteError:", exc)
"""


def test_write_failing_halfway_cleans_up_and_raises(tmp_path):
    child = run_python(FULL_DISK_WRITER, str(tmp_path))
    out, err = child.communicate(timeout=60)
    assert out.startswith("PayloadWriteError: writing payload file "), err
    assert "File too large" in out
    assert [p.name for p in (tmp_path / "v1").iterdir()] == []


class FailingPutFS(MemoryFileSystem):
    def pipe_file(self, path, value, **kwargs):
        raise OSError(28, "No space left on device")


def test_failed_put_raises_and_publishes_nothing():
    root = "/r3test-failed-put"
    fs = FailingPutFS(global_store=False, skip_instance_cache=True)
    with pytest.raises(PayloadWriteError, match="No space left"):
        PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})
    assert fs.find(root) == []
