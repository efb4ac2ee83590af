"""Bounded, seeded attack campaigns on payload roots, for any store (local classes and S3).

Each campaign drives the public API with generated cases and checks every outcome against what
must hold: bytes from inside the root or a typed error, never a file outside it, a partial file
under a final name, a hang, a leaked or twice-closed file, or a deletion before its step was
read. ``tests/payload/test_payload_campaigns.py`` runs them on every local-backed filesystem
class; ``tests/integration/test_s3_campaigns.py`` on the real S3 store.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import posixpath
import random
import signal
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from r3data.errors import (
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadWriteError,
    R3DataError,
    SegmentError,
)
from r3data.payload import (
    PayloadReader,
    PayloadRetention,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    clip,
    gc,
    min_fresh_version,
    verify,
)
from r3data.payload.reader import OpenFiles, RangeRead

SHAPE = (48, 8)


class SubclassedLocal(LocalFileSystem):
    """A LocalFileSystem subclass, as a library or a test harness would make one."""

    cachable = False


def local_classes(base: Path) -> dict[str, Callable[[], tuple[str, AbstractFileSystem]]]:
    """Every local-backed filesystem class, each giving (root inside it, filesystem) for the
    payload root at ``base / 'payloads'``."""
    root = str(base / "payloads")
    return {
        "LocalFileSystem": lambda: (root, LocalFileSystem()),
        "subclass": lambda: (root, SubclassedLocal()),
        "DirFileSystem": lambda: ("payloads", DirFileSystem(str(base), LocalFileSystem())),
        "DirFileSystem(subclass)": lambda: (
            "payloads",
            DirFileSystem(str(base), SubclassedLocal()),
        ),
        "DirFileSystem(DirFileSystem)": lambda: (
            "payloads",
            DirFileSystem(base.name, DirFileSystem(str(base.parent), LocalFileSystem())),
        ),
    }


LOCAL_CLASSES = list(local_classes(Path("/")))


def routes(rng: np.random.Generator, rows: int) -> np.ndarray:
    return rng.integers(0, 256, (rows, *SHAPE), dtype=np.uint8)


def stored(root: PayloadRoot) -> set[str]:
    """Every file under the root, root-relative (no listing cache)."""
    root.fs.invalidate_cache(root.path)
    if not root.fs.exists(root.path):
        return set()
    return {name for name, _ in root.files(root.fs.find(root.path, detail=True).values())}


def read_outcome(
    reader: PayloadReader,
    segment: PayloadSegment,
    handle: str,
    refusals: tuple[type[Exception], ...] = (PayloadHandleError, SegmentError),
) -> tuple[str, Any]:
    """One read of ``segment``'s routes from the file ``handle`` names, as a campaign counts
    it: ``("read", rows)``, ``("refused", None)`` (one of ``refusals``; by default a handle
    the root refuses, or an empty or NUL-bearing one refused as a segment) or
    ``("not found", None)``."""
    try:
        return "read", reader.read([moved(segment, handle)])["routes"]
    except refusals:
        return "refused", None
    except PayloadNotFoundError:
        return "not found", None


def moved(segment: PayloadSegment, file: str) -> PayloadSegment:
    return PayloadSegment(**{**segment.to_dict(), "file": file})


# --- handle escapes --------------------------------------------------------------------------


@dataclass
class Spellings:
    """Ways a store lets a handle name a path: relative to the root, or whole."""

    root_prefixes: list[str]
    """Prefixes that name the root itself, e.g. ``/abs/root/`` or ``s3://bucket/run/``."""
    outside: dict[str, bytes]
    """Whole spellings of files outside the root -> their bytes (which must never come back)."""


def _neutral(rng: random.Random, rel: str) -> str:
    """``rel`` spelled another way that normalises to it (``./``, ``//``, ``x/..``)."""
    parts = rel.split("/")
    out: list[str] = []
    for part in parts:
        choice = rng.random()
        if choice < 0.15:
            out.append(".")
        elif choice < 0.3:
            out += ["zz", ".."]
        out.append(part)
    text = "/".join(out)
    return text.replace("/", "//", 1) if rng.random() < 0.2 else text


def escape_campaign(
    root: str,
    fs: AbstractFileSystem | None,
    spellings: Spellings,
    inside: dict[str, PayloadSegment],
    expected: dict[str, np.ndarray],
    rng: random.Random,
    cases: int,
) -> dict[str, int]:
    """Read ``cases`` generated handles: each names an inside file (in any spelling), an outside
    one, or garbage. An inside one must read back exactly; anything else must be refused (or not
    found: a lexically inside path that does not exist). Returns the outcome counts."""
    reader = PayloadReader(root, fs=fs, retries=0, workers=2)
    names = sorted(inside)
    counts = {"read": 0, "refused": 0, "not found": 0}
    for _ in range(cases):
        kind = rng.random()
        name = rng.choice(names)
        segment = inside[name]
        if kind < 0.45:
            rel = _neutral(rng, name)
            handle = rng.choice(["", *spellings.root_prefixes]) + rel
            want: Any = expected[name]
        elif kind < 0.9:
            target = rng.choice(sorted(spellings.outside))
            handle = rng.choice(
                [
                    target,
                    "../" * rng.randint(1, 3) + target.lstrip("/"),
                    f"v1/{'../' * rng.randint(2, 4)}{target.lstrip('/')}",
                ]
            )
            want = None
        else:
            words = ["..", "/", ".", "v1", "\x00", "~", ":", "%2e"]
            handle = "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            want = None
        outcome, got = read_outcome(reader, segment, handle)
        if outcome != "read":
            counts[outcome] += 1
            continue
        for secret in spellings.outside.values():
            assert got.tobytes() != secret[segment.offset : segment.offset + segment.nbytes], handle
        assert want is not None, f"{handle!r} was read ({got.shape}) but names no inside file"
        np.testing.assert_array_equal(got, want, err_msg=repr(handle))
        counts["read"] += 1
    return counts


def local_oracle(os_root: str, whole_root: str, file_urls: bool, handle: str) -> str:
    """What reading ``handle`` under a local-backed root must give, decided independently of
    r3data: ``"refused"``, ``"not found"`` or the real path of the file to read. The root is at
    ``os_root`` on disk and spelled ``whole_root`` in a whole (absolute) handle; ``file_urls``
    tells whether ``file://`` URLs are the filesystem's own."""
    if "\x00" in handle or not handle:
        return "refused"
    if handle.startswith("file://"):
        if not file_urls:
            return "refused"
        handle = handle.removeprefix("file://")
    if handle.startswith("/"):
        whole = posixpath.normpath(handle)
        if not whole.startswith(whole_root + "/"):
            return "refused"
        rel = whole[len(whole_root) + 1 :]
    else:
        rel = posixpath.normpath(handle)
        if rel == "." or rel == ".." or rel.startswith("../"):
            return "refused"
    path = posixpath.join(os_root, rel)
    try:
        info = os.stat(path)
    except OSError as exc:
        return "refused" if exc.errno == errno.ELOOP else "not found"
    real = os.path.realpath(path)
    if not real.startswith(os.path.realpath(os_root) + "/") or not stat.S_ISREG(info.st_mode):
        return "refused"
    return real


def plant_hostile_tree(base: Path, secret: bytes) -> Path:
    """Links, loops, FIFOs and directories inside ``base / 'payloads'`` (which holds ``v1/``),
    pointing in and out of it; the outside files hold ``secret``. Returns the outside folder."""
    root, outside = base / "payloads", base / "outside"
    (outside / "v1").mkdir(parents=True)
    (outside / "v1" / "a.bin").write_bytes(secret)
    (outside / "passwd").write_bytes(secret)
    v1 = root / "v1"
    (v1 / "rel_out.bin").symlink_to("../../outside/v1/a.bin")
    (v1 / "abs_out.bin").symlink_to(outside / "v1" / "a.bin")
    (v1 / "in.bin").symlink_to("a.bin")
    (v1 / "up").symlink_to("..")  # a directory link that stays inside
    (v1 / "etc").symlink_to(outside)  # one that leads out
    (root / "v9").symlink_to(outside / "v1")  # a version directory that leads out
    (v1 / "loop.bin").symlink_to("loop.bin")
    (v1 / "dangling.bin").symlink_to("nowhere.bin")
    (v1 / "dir.bin").mkdir()
    os.mkfifo(v1 / "fifo.bin")
    return outside


FOLDER_WORDS = {"v1": 6, "v9": 1, "..": 1, ".": 1, "up": 1, "etc": 1, "": 1}
FILE_WORDS = {
    "a.bin": 4,
    "in.bin": 2,
    "rel_out.bin": 1,
    "abs_out.bin": 1,
    "loop.bin": 1,
    "dangling.bin": 1,
    "dir.bin": 1,
    "fifo.bin": 1,
    "passwd": 1,
    "v1": 1,
}


def _word(rng: random.Random, words: dict[str, int]) -> str:
    return rng.choices(list(words), weights=list(words.values()))[0]


def symlink_campaign(
    root: str,
    fs: AbstractFileSystem,
    os_root: str,
    segment: PayloadSegment,
    rng: random.Random,
    cases: int,
) -> dict[str, int]:
    """Random paths through the hostile tree (see :func:`plant_hostile_tree`); each read must
    match :func:`local_oracle` exactly: the file's bytes, refused, or not found."""
    reader = PayloadReader(root, fs=fs, retries=0, workers=1)
    file_urls = isinstance(fs, LocalFileSystem)
    whole_root = os_root if file_urls else "/" + root.strip("/")  # a DirFileSystem's namespace
    counts = {"read": 0, "refused": 0, "not found": 0}
    prefixes = ["", "", whole_root + "/", "file://" + os_root + "/", os.path.dirname(os_root) + "/"]
    for _ in range(cases):
        depth = rng.choices([0, 1, 2, 3], weights=[1, 6, 2, 1])[0]
        folders = [_word(rng, FOLDER_WORDS) for _ in range(depth)]
        handle = rng.choice(prefixes) + "/".join([*folders, _word(rng, FILE_WORDS)])
        want = local_oracle(os_root, whole_root, file_urls, handle)
        outcome, got = read_outcome(reader, segment, handle)
        if want in ("refused", "not found"):
            assert outcome == want, (handle, want, outcome)
        else:
            assert outcome == "read", (handle, want, outcome)
            data = Path(want).read_bytes()[segment.offset : segment.offset + segment.nbytes]
            assert got.tobytes() == data, handle
        counts[outcome] += 1
    return counts


def swapping_tree_campaign(
    root: str,
    fs: AbstractFileSystem,
    base: Path,
    segment: PayloadSegment,
    want: np.ndarray,
    reads: int,
) -> dict[str, int]:
    """Read ``segment`` (in ``v2``) again and again with one reader while another thread swaps
    ``v2`` between the real directory and links to a copy outside the root (its bytes zeroed).
    Every read must give the inside bytes, or be refused or not found."""
    payloads, outside = base / "payloads", base / "outside-v2"
    real = payloads / ".v2-real"
    (payloads / "v2").rename(real)
    outside.mkdir()
    name = posixpath.basename(segment.file)
    (outside / name).write_bytes(bytes((real / name).stat().st_size))
    stop = threading.Event()

    def swap() -> None:
        """Each state lasts a moment, letting the reader in (``sleep`` releases the GIL)."""
        targets = [".v2-real", str(outside)]
        i = 0
        while not stop.is_set():
            link = payloads / f".v2-link-{i % 2}"
            link.symlink_to(targets[i % 2])
            os.replace(link, payloads / "v2")  # atomic: the name always exists
            time.sleep(0.0001)
            i += 1
            if i % 7 == 0:  # sometimes the real directory itself, or nothing at all
                os.unlink(payloads / "v2")
                time.sleep(0.0001)
                real.rename(payloads / "v2")
                time.sleep(0.0001)
                (payloads / "v2").rename(real)

    swapper = threading.Thread(target=swap, daemon=True)
    (payloads / "v2").symlink_to(".v2-real")
    swapper.start()
    reader = PayloadReader(root, fs=fs, retries=0, workers=1)
    counts = {"read": 0, "refused": 0, "not found": 0}
    unchecked = PayloadSegment(
        **{**segment.to_dict(), "crc32c": None}
    )  # no checksum to hide behind
    try:
        for _ in range(reads):
            outcome, got = read_outcome(reader, unchecked, unchecked.file, (PayloadHandleError,))
            if outcome == "read":
                np.testing.assert_array_equal(got, want)
            counts[outcome] += 1
    finally:
        stop.set()
        swapper.join()
    return counts


def confined_deletions(root: str, fs: AbstractFileSystem, outside: Path) -> None:
    """Retention and gc told to delete through links out of the root delete nothing outside."""
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with PayloadRetention(root, 0, fs=fs, fresh=False) as retention:
        retention.claim(0, ["v9/a.bin", "v1/etc/passwd", "v1/abs_out.bin", "v1/up/v9/a.bin"])
        retention.on_policy_update(3)
    gc(root, 50, 0, fs=fs)
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


# --- killed writers --------------------------------------------------------------------------


def write_until_killed(
    root: str, fs: AbstractFileSystem, seed: int, max_rows: int, out: Any
) -> None:
    """The child: publish files of random sizes until killed, sending each name once published."""
    rng = np.random.default_rng(seed)
    writer = PayloadWriter(root, fs=fs)
    out.send("ready")
    while True:
        rows = int(rng.integers(1, max_rows))
        mask = [np.arange(int(n), dtype=np.int32) for n in rng.integers(0, 9, rows)]
        (segment, _) = writer.write(
            int(rng.integers(0, 3)), {"routes": routes(rng, rows), "mask": mask}
        )
        out.send(segment.file)


def forkserver() -> multiprocessing.context.BaseContext:
    """Children forked from a server that imported r3data once (each starts in milliseconds)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["r3data.payload", "payload_campaigns"])
    return context


def killed_writer_campaign(
    root: str,
    fs: AbstractFileSystem,
    rng: random.Random,
    kills: int,
    max_rows: int,
    max_delay: float,
) -> dict[str, int]:
    """Kill ``kills`` writers at random points (after 0 to 2 files they published, then a random
    delay into the next); then every file under a final name is complete (verify finds nothing
    corrupt or headerless) and every file a writer reported exists."""
    context = forkserver()
    published: list[str] = []
    for _ in range(kills):
        parent, child = context.Pipe(duplex=False)
        process = context.Process(
            target=write_until_killed, args=(root, fs, rng.randrange(2**31), max_rows, child)
        )
        process.start()
        child.close()
        assert parent.poll(60), "the writer never started"
        assert parent.recv() == "ready"
        for _ in range(rng.randint(0, 2)):
            assert parent.poll(60), "the writer published nothing in a minute"
            published.append(parent.recv())
        time.sleep(rng.uniform(0, max_delay))
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        assert process.exitcode == -signal.SIGKILL
        with parent:
            while parent.poll():
                try:
                    published.append(parent.recv())
                except EOFError:
                    break
    report = verify(root, fs=fs)
    assert report.corrupt == {}
    assert report.headerless == []
    assert report.unreadable == {}
    listed = stored(PayloadRoot(root, fs))
    assert set(published) <= listed
    finals = {name for name in listed if not posixpath.basename(name).startswith(".")}
    assert report.files_checked == len(finals)
    return {"published": len(published), "finals": len(finals), "temporary": len(report.temporary)}


# --- full disks ------------------------------------------------------------------------------


def fill_disk_campaign(
    root: str, fs: AbstractFileSystem, seed: int, writes: int, max_rows: int
) -> dict[str, int]:
    """Write files of random sizes onto a filesystem that runs out of space; every failure is a
    ``PayloadWriteError`` that leaves the root exactly as it was; every success is complete."""
    rng = np.random.default_rng(seed)
    writer = PayloadWriter(root, fs=fs)
    payload_root = PayloadRoot(root, fs)
    published: dict[str, np.ndarray] = {}
    counts = {"published": 0, "failed": 0}
    for _ in range(writes):
        before = stored(payload_root)
        data = routes(rng, int(rng.integers(1, max_rows)))
        try:
            (segment,) = writer.write(int(rng.integers(0, 2)), {"routes": data})
        except PayloadWriteError as exc:
            failure = str(exc)
        else:
            published[segment.file] = data
            counts["published"] += 1
            continue
        assert any(s in failure for s in ("No space left", "File too large")), failure
        assert stored(payload_root) == before, "a failed write left something behind"
        counts["failed"] += 1
        for name in rng.permutation(sorted(published))[: int(rng.integers(1, 4))]:
            payload_root.remove(name)  # make room: the disk fills again later
            del published[name]
    report = verify(root, fs=fs)
    assert (report.corrupt, report.temporary, report.headerless) == ({}, [], [])
    assert report.files_checked == len(published)
    return counts


# --- flaky reads -----------------------------------------------------------------------------


class ClientLibraryError(Exception):
    """What a client library raises on its own (botocore's errors are not ``OSError``s)."""


FAULTS = ("eio", "client", "gone", "short", "eof", "corrupt")


class FlakyFile:
    """An open file whose reads fail, come up short, end early or flip a byte, now and then."""

    def __init__(self, f: Any, fs: Any) -> None:
        self.f, self.fs, self.closes = f, fs, 0

    @property
    def closed(self) -> bool:
        return self.closes > 0

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def readinto(self, buffer: Any) -> int:
        fault = self.fs.read_fault()
        view = memoryview(buffer).cast("B")
        if fault == "eof":
            return 0
        if fault == "short" and len(view) > 1:
            view = view[: len(view) // 2]
        n = self.f.readinto(view) or 0
        if fault == "corrupt" and n and self.fs.corrupting:
            view[n // 2] ^= 0x40
        return n

    def close(self) -> None:
        self.closes += 1
        self.f.close()


def flaky(base: type[AbstractFileSystem]) -> type[AbstractFileSystem]:
    """``base`` whose ``info`` and reads fail at ``rate`` with a seeded choice of
    :data:`FAULTS`: the reads of its opened files, which it records to check each is closed
    exactly once, and on an event-loop filesystem (which r3data reads with ranged
    ``cat_file`` calls) its ``_info`` and ``_cat_file`` too."""

    class Flaky(base):  # type: ignore[misc, valid-type]
        cachable = False

        def __init__(self, *args: Any, rate: float, seed: int, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rate, self.rng, self.lock = rate, random.Random(seed), threading.Lock()
            self.opened: list[FlakyFile] = []
            self.corrupting = False

        def fault(self) -> str | None:
            with self.lock:
                if self.rng.random() >= self.rate:
                    return None
                return self.rng.choice(FAULTS)

        def read_fault(self) -> str | None:
            """A fault for one read: raised here, or returned (short, eof, corrupt) to fake."""
            fault = self.fault()
            if fault == "eio":
                raise OSError(errno.EIO, "Input/output error")
            if fault == "client":
                raise ClientLibraryError("connection reset by peer")
            if fault == "gone":
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
            return fault

        def info_fault(self, path: str) -> None:
            fault = self.fault()
            if fault in ("eio", "short", "eof", "corrupt"):
                raise OSError(errno.EIO, "Input/output error", path)
            if fault == "client":
                raise ClientLibraryError("connection refused")
            if fault == "gone":
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            self.info_fault(path)
            return super().info(path, **kwargs)

        if issubclass(base, AsyncFileSystem):

            async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
                self.info_fault(path)
                return await super()._info(path, **kwargs)

            async def _cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any):
                fault = self.read_fault()
                if fault == "eof":
                    return b""
                if fault == "short" and end - start > 1:
                    end = start + (end - start) // 2
                data = await super()._cat_file(path, start=start, end=end, **kw)
                if fault == "corrupt" and data and self.corrupting:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x40
                return bytes(data)

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            f = super()._open(path, mode, **kwargs)
            if "r" not in mode:
                return f
            wrapped = FlakyFile(f, self)
            with self.lock:
                self.opened.append(wrapped)
            return wrapped

    return Flaky


def flaky_reads_campaign(
    root: str, fs: Any, rng: random.Random, calls: int, files: int
) -> dict[str, int]:
    """Random jobs through ``read``, ``read_into`` and ``read_many`` with random retries on a
    flaky filesystem: each call returns exactly the bytes written or raises a typed payload
    error, and every file it opened is closed exactly once."""
    gen = np.random.default_rng(rng.randrange(2**31))
    rate = fs.rate
    fs.rate = 0.0
    writer = PayloadWriter(root, fs=fs)
    written: list[tuple[PayloadSegment, PayloadSegment, np.ndarray, list[np.ndarray]]] = []
    for _ in range(files):
        rows = int(gen.integers(1, 300))
        data = routes(gen, rows)
        mask = [np.arange(int(n), dtype=np.int32) for n in gen.integers(0, 6, rows)]
        fixed, ragged = writer.write(1, {"routes": data, "mask": mask}, pos=100)
        written.append((fixed, ragged, data, mask))
    fs.rate = rate
    counts = {"ok": 0, "typed error": 0}
    for _ in range(calls):
        reader = PayloadReader(
            root,
            fs=fs,
            retries=rng.choice([0, 1, 2, 4]),
            backoff=0.0,
            max_backoff=0.0,
            workers=rng.choice([1, 3]),
        )
        picked = rng.sample(written, rng.randint(1, min(4, len(written))))
        jobs = []
        for fixed, _, data, _ in picked:
            lo = rng.randint(0, fixed.rows - 1)
            hi = rng.randint(lo + 1, fixed.rows)
            whole = rng.random() < 0.5
            segments = [fixed] if whole else clip([fixed], 100 + lo, 100 + hi)
            jobs.append((segments, data if whole else data[lo:hi]))
        fs.corrupting = all(s.crc32c is not None for segments, _ in jobs for s in segments)
        api = rng.choice(["read", "read_into", "read_many", "ragged"])
        opened_before = len(fs.opened)
        try:
            if api == "read_many":
                outs = [np.zeros_like(want) for _, want in jobs]
                reader.read_many(
                    [(segments, out) for (segments, _), out in zip(jobs, outs, strict=True)]
                )
                for out, (_, want) in zip(outs, jobs, strict=True):
                    np.testing.assert_array_equal(out, want)
            elif api == "read_into":
                segments, want = jobs[0]
                out = np.zeros_like(want)
                reader.read_into(segments, out)
                np.testing.assert_array_equal(out, want)
            elif api == "read":
                segments, want = jobs[0]
                np.testing.assert_array_equal(reader.read(segments)["routes"], want)
            else:
                fixed, ragged, _, mask = picked[0]
                fs.corrupting = True
                got = reader.read([ragged])["mask"]
                np.testing.assert_array_equal(got.values, np.concatenate(mask))
                assert got.lengths.tolist() == [len(m) for m in mask]
            counts["ok"] += 1
        except R3DataError:
            counts["typed error"] += 1
        new = fs.opened[opened_before:]
        assert all(f.closes == 1 for f in new), [f.closes for f in new]
    return counts


# --- retention with restarts -----------------------------------------------------------------


@dataclass
class RetentionModel:
    """What the trainer did: files written, claims per step, what it read."""

    version_of: dict[str, int] = field(default_factory=dict)
    claims: dict[int, set[str]] = field(default_factory=dict)


def retention_campaign(
    root: str,
    fs: AbstractFileSystem | None,
    rng: random.Random,
    steps: int,
    max_off: int,
    restarts: float,
) -> dict[str, int]:
    """A trainer that writes rollouts, ships the batch of each step and prefetches the next,
    reads each batch just before its optimizer step, and restarts (a new retention on the same
    root, the in-flight batch claimed again, as a resumed loader does) now and then. Every file
    of a batch exists when the batch is read; after the last step and the backstop, no file of
    a ``v<k>`` directory is left."""
    writer = PayloadWriter(root, fs=fs)
    reader = PayloadReader(root, fs=fs, retries=0)
    payload_root = PayloadRoot(root, fs)
    model = RetentionModel()
    segments: dict[str, PayloadSegment] = {}
    retention = PayloadRetention(root, max_off, fs=fs, fresh=False)
    counts = {"files": 0, "restarts": 0, "read": 0}

    def ship(step: int) -> None:
        live = [f for f in model.version_of if f in stored_now]
        fresh = [f for f in live if model.version_of[f] >= min_fresh_version(step, max_off)]
        picked = set(rng.sample(fresh, rng.randint(0, len(fresh)))) if fresh else set()
        model.claims.setdefault(step, set()).update(picked)
        retention.claim(step, sorted(picked))
        dropped = rng.sample(live, rng.randint(0, min(2, len(live)))) if live else []
        retention.discard([f for f in dropped if not any(f in c for c in model.claims.values())])

    stored_now: set[str] = set()
    for step in range(steps):
        for _ in range(rng.randint(0, 3)):
            version = rng.randint(max(0, step - max_off), step)
            (segment,) = writer.write(version, {"routes": np.full((2, *SHAPE), step, np.uint8)})
            model.version_of[segment.file] = version
            segments[segment.file] = segment
            counts["files"] += 1
        stored_now = stored(payload_root)
        if step == 0:
            ship(0)
        ship(step + 1)  # the prefetched batch
        if rng.random() < restarts:  # the trainer restarts from its checkpoint before `step`
            retention.close()
            retention = PayloadRetention(root, max_off, fs=fs, fresh=False)
            for claimed_step in (step, step + 1):
                retention.claim(claimed_step, sorted(model.claims.get(claimed_step, ())))
            counts["restarts"] += 1
        batch = sorted(model.claims.get(step, ()))
        missing = sorted(set(batch) - stored(payload_root))
        assert not missing, f"step {step}: files deleted before their batch was read: {missing}"
        if batch:
            reader.read([segments[f] for f in batch])
            counts["read"] += len(batch)
        retention.on_policy_update(step)
        retention.wait()
    retention.on_policy_update(steps + max_off + 1)
    retention.close()
    left = sorted(f for f in stored(payload_root) if f.split("/")[0].startswith("v"))
    assert not left, f"left after the backstop: {left}"
    return counts


# --- permissions -----------------------------------------------------------------------------

PERMISSION_ROUTES = np.arange(16 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(16, 48, 8)


def permission_checks_as_nobody(root: str, out: Any) -> None:
    """As ``nobody`` under ``root`` (writable by all; ``v2/root.bin`` root's): a file made
    unreadable, one made unreadable after its size check (read through the descriptor the
    check kept), and a deletion in a folder it may not write; sends what it found."""
    os.setgid(65534)
    os.setuid(65534)
    found = {}
    writer, reader = PayloadWriter(root), PayloadReader(root, retries=4, backoff=0.5)
    own = writer.write(1, {"routes": PERMISSION_ROUTES})[0]
    os.chmod(os.path.join(root, own.file), 0)
    started = time.monotonic()
    try:
        reader.read([own])
    except PayloadPermissionError as exc:
        found["denied"] = (str(exc), time.monotonic() - started)
    kept = writer.write(1, {"routes": PERMISSION_ROUTES})[0]
    opened = OpenFiles()
    reader.check_sizes([kept], opened)
    os.chmod(os.path.join(root, kept.file), 0)  # after the check: the open file still reads
    out_rows = np.zeros_like(PERMISSION_ROUTES)
    ranges = [RangeRead(kept, kept.offset, kept.nbytes, memoryview(out_rows.reshape(-1)))]
    for job in reader.file_jobs(ranges, opened):  # as the loader's fill reads a checked plan
        job()
    found["kept"] = bool((out_rows == PERMISSION_ROUTES).all())
    opened.close()
    with PayloadRetention(root, 8, fresh=False) as retention:
        retention.claim(0, ["v2/root.bin"])
        retention.on_policy_update(0)
    found["delete_errors"] = retention.metrics().delete_errors
    out.send(found)
