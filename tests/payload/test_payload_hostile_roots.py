"""Attacks beyond the campaigns: every spelling of a way out; wrappers over a local filesystem
(caches, async adapters) and classes no check can confine; a tree changing under a running
loader, a writer and a reader; sockets and /proc magic links; kernels without openat2;
deletions through links inside the root; retention under a shuffled, resumed loader."""

from __future__ import annotations

import gc as python_gc
import os
import posixpath
import random
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.generic import GenericFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from payload_campaigns import (
    LOCAL_CLASSES,
    forkserver,
    local_classes,
    moved,
    permission_checks_as_nobody,
    plant_hostile_tree,
    swapping_tree_campaign,
    symlink_campaign,
)

import r3data.payload.fs as payload_fs
from r3data import loader
from r3data.errors import (
    ConfigError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadReadError,
    PayloadWriteError,
    R3DataError,
    SegmentError,
)
from r3data.nodes import MicroBatches, Shuffle
from r3data.payload import (
    PayloadReader,
    PayloadRetention,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    gc,
    shift,
    verify,
)

ROUTES = np.arange(16 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(16, 48, 8)
SECRET = b"S" * 4096
REFUSALS = (PayloadHandleError, PayloadNotFoundError, SegmentError)
"""A handle refused by the root, one that does not exist, one no segment may carry (NUL)."""


def hostile_spellings(base: Path, root: str) -> list[str]:
    """Handles that spell a way out of ``root`` (at ``base / 'payloads'``) or name something
    that is not a file of it; ``base / 'secret.bin'`` is the file outside."""
    secret = str(base / "secret.bin")
    return [
        "%2e%2e/secret.bin",
        "v1/%2e%2e/%2e%2e/secret.bin",
        "..%2fsecret.bin",
        "..\\secret.bin",
        "v1\\..\\..\\secret.bin",
        "\u2025/secret.bin",  # two dot leader
        "\uff0e\uff0e/secret.bin",  # fullwidth dots
        "..\uff0fsecret.bin",  # fullwidth slash
        "..\u0338/secret.bin",
        "v1/..\x00/secret.bin",
        "../secret.bin.",
        ".. /secret.bin",
        "../ secret.bin",
        "...",
        "..../secret.bin",
        "v1//..//..//secret.bin",
        "",
        ".",
        "./",
        "v1",
        "v1/",
        "/",
        root,
        root + "/",
        root + "/.",
        "~",
        "~/secret.bin",
        "~root/secret.bin",
        "\ud800",
        "v1/\udfff.bin",
        "a" * 300,
        "v1/" + "a/" * 3000 + "x.bin",
        secret,
        "//" + secret.lstrip("/"),
        "file://" + secret,
        "file://localhost" + secret,
        "file://host/../secret.bin",
        "file:" + secret,
        "local://" + secret,
        "FILE://" + secret,
        "simplecache::" + secret,
        "simplecache::file://" + secret,
        "s3://other-bucket/secret.bin",
        "memory://secret.bin",
        "v1/a.bin?x=../../secret.bin",
        "v1/a.bin#../../secret.bin",
        root + "/../secret.bin",
        "file://" + root + "/../secret.bin",
    ]


def planted(tmp_path: Path, kind: str) -> tuple[Path, str, fsspec.AbstractFileSystem]:
    base = tmp_path / "base"
    base.mkdir()
    (base / "secret.bin").write_bytes(SECRET)
    return base, *local_classes(base)[kind]()


@pytest.mark.parametrize("kind", [*LOCAL_CLASSES, "memory"])
def test_every_spelling_of_a_way_out_is_a_typed_refusal(tmp_path, kind):
    """Refused, or not found (a lexically inside name that does not exist), never the bytes
    outside nor an untyped error."""
    if kind == "memory":
        base = tmp_path / "base"
        base.mkdir()
        fs = MemoryFileSystem(global_store=False, skip_instance_cache=True)
        fs.pipe_file(str(base / "secret.bin"), SECRET)
        root = str(base / "payloads")
    else:
        base, root, fs = planted(tmp_path, kind)
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    whole = PayloadRoot(root, fs).path
    reader = PayloadReader(root, fs=fs, retries=0)
    for handle in hostile_spellings(base, whole if whole.startswith("/") else "/" + whole):
        with pytest.raises(R3DataError) as caught:
            reader.read([moved(segment, handle)])
        assert isinstance(caught.value, REFUSALS), (
            handle,
            caught.value,
        )
    np.testing.assert_array_equal(reader.read([segment])["routes"], ROUTES)


def test_a_lone_surrogate_or_a_name_too_long_is_a_handle_error_not_retried(tmp_path):
    """A hostile name is refused at once, naming it: no retry makes it readable."""
    root = tmp_path / "payloads"
    segment = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    reader = PayloadReader(str(root), retries=4, backoff=1.0, max_backoff=1.0)
    cases = {"v1/\ud800": r"must be a path in utf-8, found 'v1/\\ud800'"}
    cases["v1/" + "a" * 300] = "names a path longer than the filesystem allows"
    cases["v1/" + "a/" * 3000 + "x.bin"] = "names a path longer than the filesystem allows"
    for handle, message in cases.items():
        started = time.monotonic()
        with pytest.raises(PayloadHandleError, match=message):
            reader.read([moved(segment, handle)])
        assert time.monotonic() - started < 0.5, handle
    assert PayloadRoot(root).relative("v1/\udcff.bin") == "v1/\udcff.bin"  # os.fsdecode's
    memory = PayloadRoot(f"memory://r3-hostile-{uuid.uuid4().hex}")  # keys are UTF-8: no bytes
    with pytest.raises(PayloadHandleError, match=r"must be a path in utf-8, found 'v1/\\udcff"):
        memory.relative("v1/\udcff.bin")


WRAPPERS = {
    "simplecache": lambda base: ("simplecache::file://" + str(base / "payloads"), None),
    "filecache": lambda base: ("filecache::file://" + str(base / "payloads"), None),
    "blockcache": lambda base: ("blockcache::file://" + str(base / "payloads"), None),
    "DirFileSystem(simplecache)": lambda base: (
        "payloads",
        DirFileSystem(str(base), fsspec.filesystem("simplecache", fs=LocalFileSystem())),
    ),
}
try:
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
except ImportError:  # fsspec < 2024.12
    pass
else:
    WRAPPERS["AsyncFileSystemWrapper"] = lambda base: (
        str(base / "payloads"),
        AsyncFileSystemWrapper(LocalFileSystem()),
    )


@pytest.mark.parametrize("kind", WRAPPERS)
def test_a_cache_or_async_wrapper_over_a_local_root_is_confined_as_the_root(tmp_path, kind):
    """A wrapper opens the OS paths of the filesystem it wraps, following symlinks: it is
    local-backed (confined by the kernel), never read through its own opens."""
    base = tmp_path / "base"
    root, fs = WRAPPERS[kind](base)
    payload_root = PayloadRoot(root, fs)
    assert payload_root.local_backed
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    payloads, outside = base / "payloads", tmp_path / "outside"
    (outside / "v1").mkdir(parents=True)
    (outside / segment.file).write_bytes(bytes((payloads / segment.file).stat().st_size))
    (payloads / "v1" / "out.bin").symlink_to(outside / segment.file)
    (payloads / "v1" / "etc").symlink_to(outside)
    (payloads / "v1" / "in.bin").symlink_to(payloads / segment.file)
    reader = PayloadReader(root, fs=fs, retries=0)
    for handle in ("v1/out.bin", f"v1/etc/{segment.file}"):
        with pytest.raises(PayloadHandleError, match="outside the root"):
            reader.read([moved(segment, handle)])
    np.testing.assert_array_equal(reader.read([moved(segment, "v1/in.bin")])["routes"], ROUTES)
    with PayloadRetention(root, 0, fs=fs, fresh=False) as retention:
        retention.claim(0, ["v1/etc/" + segment.file, segment.file])
        retention.on_policy_update(0)
    assert (outside / segment.file).exists()
    assert not (payloads / segment.file).exists()


@pytest.mark.parametrize(
    "make",
    [
        lambda: ("http://127.0.0.1:9/run", None),
        lambda: ("https://127.0.0.1:9/run", None),
        lambda: ("simplecache::http://127.0.0.1:9/run", None),
        lambda: ("run", DirFileSystem("http://127.0.0.1:9", fsspec.filesystem("http"))),
    ],
    ids=["http", "https", "simplecache(http)", "DirFileSystem(http)"],
)
def test_http_roots_are_refused(make):
    """An HTTP client percent-decodes ``%2e%2e`` and removes the dot segments (a handle
    ``v1/%2e%2e/%2e%2e/secret`` reads ``/secret`` of the server), so no root there is safe."""
    pytest.importorskip("aiohttp")
    root, fs = make()
    for build in (PayloadRoot, lambda r, f: PayloadReader(r, fs=f)):
        with pytest.raises(ConfigError, match=r"reads HTTP URLs.*expected a local path"):
            build(root, fs)


def test_a_root_leaving_its_dirfilesystem_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"expected a path inside DirFileSystem's folder"):
        PayloadRoot("../run", fs=DirFileSystem(str(tmp_path / "base"), LocalFileSystem()))


def test_a_generic_filesystem_root_is_refused(tmp_path):
    """``GenericFileSystem`` opens whatever filesystem a path's URL names: over a local one it
    followed a symlink out of the root."""
    with pytest.raises(ConfigError, match=r"reads URLs of any filesystem.*expected a local"):
        PayloadRoot(tmp_path, fs=GenericFileSystem())


def test_object_store_like_roots_stay_accepted():
    """The refusal is by class, not a blanket one: memory and S3 roots are confined lexically."""
    assert not PayloadRoot(f"memory://r3-hostile-{uuid.uuid4().hex}").local_backed
    pytest.importorskip("s3fs")
    assert not PayloadRoot("s3://bucket/run", fs=fsspec.filesystem("s3", anon=True)).local_backed


@pytest.mark.parametrize("cache", ["filecache", "simplecache"])
def test_a_cache_naming_copies_by_base_name_is_refused_where_it_is_read_through(tmp_path, cache):
    """Over a store, ``same_names=True`` gives ``v1/x.bin`` and ``v2/x.bin`` one cached copy:
    the second read returned the first's bytes. Over a local root the kernel opens the files
    (no cache serves them), so it stays accepted; the default, a hash of the path, is read."""
    store = MemoryFileSystem(skip_instance_cache=True)
    base = f"/r3-cache-{uuid.uuid4().hex}/payloads"
    for version, fill in (("v1", b"A"), ("v2", b"B")):
        store.pipe_file(f"{base}/{version}/x.bin", fill * 16)

    def over(inner, **options):
        return fsspec.filesystem(cache, fs=inner, cache_storage=str(tmp_path / "c"), **options)

    with pytest.raises(ConfigError, match=r"BasenameCacheMapper.*one copy.*expected the default"):
        PayloadRoot(base, fs=over(store, same_names=True))
    reader = PayloadReader(base, fs=over(store), retries=0)
    for version, fill in (("v1", b"A"), ("v2", b"B")):
        segment = PayloadSegment("r", f"{version}/x.bin", 0, 0, 16, "uint8")
        assert reader.read([segment])["r"].tobytes() == fill * 16
    assert PayloadRoot(tmp_path, fs=over(LocalFileSystem(), same_names=True)).local_backed


def test_a_name_fsdecode_made_reads_that_file(tmp_path):
    """A handle holding ``os.fsdecode``'s escapes of non-UTF-8 bytes names that file."""
    root = tmp_path / "payloads"
    segment = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    name = os.fsdecode(b"v1/\xff.bin")
    os.rename(root / segment.file, os.fsencode(str(root)) + b"/v1/\xff.bin")
    got = PayloadReader(str(root), retries=0).read([moved(segment, name)])["routes"]
    np.testing.assert_array_equal(got, ROUTES)


def swap_forever(payloads: Path, outside: Path, names: list[str], stop: threading.Event) -> None:
    """Swap ``v0`` between the real folder and a link to ``outside`` (the same names, other
    bytes), and its files for links to their outside twins, until ``stop``; every state lasts
    a moment (``sleep`` lets the loader's threads in)."""
    real, rng, i = payloads / ".v0-real", random.Random(0), 0
    (payloads / "v0").rename(real)
    (payloads / "v0").symlink_to(".v0-real")
    while not stop.is_set():
        i += 1
        link = payloads / f".v0-link-{i % 2}"
        link.symlink_to(".v0-real" if i % 2 else str(outside))
        os.replace(link, payloads / "v0")
        name = rng.choice(names)
        twin = real / f".{name}-twin"
        twin.symlink_to(outside / name)
        os.rename(real / name, real / f".{name}-kept")  # the real file, put back below
        os.replace(twin, real / name)
        time.sleep(0.0002)
        os.replace(real / f".{name}-kept", real / name)
        time.sleep(0.0002)
    os.replace(real, payloads / "v0-restored")


def test_a_loader_running_across_steps_never_reads_a_byte_from_outside(tmp_path):
    """While another thread swaps the version folder and its files for symlinks to copies
    outside the root (other bytes, so that a read from outside fails its checksum), every
    batch of the running loader is exact or the loader stops with a refusal (or a file gone
    for a moment); a checksum mismatch would mean bytes from outside were read."""
    payloads, outside = tmp_path / "payloads", tmp_path / "outside"
    writer = PayloadWriter(str(payloads))
    rng = np.random.default_rng(5)
    samples, expected = [], []
    for i in range(24):
        rows = rng.integers(0, 16, (5, 2, 2)).astype(np.uint8)
        (segment,) = writer.write(0, {"routed_experts": rows})
        request = {"prompt_len": 3, "completion_len": 3, "sources": [segment.to_dict()]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(6), "requests": [request]})
        expected.append(rows)
    names = sorted(p.name for p in (payloads / "v0").iterdir())
    outside.mkdir()
    for name in names:
        (outside / name).write_bytes(bytes(b ^ 0x5A for b in (payloads / "v0" / name).read_bytes()))
    stop = threading.Event()
    swapper = threading.Thread(target=swap_forever, args=(payloads, outside, names, stop))
    swapper.start()
    outcomes = {"batch": 0, "refused": 0, "gone": 0}
    try:
        for attempt in range(12):
            batches = loader(
                samples,
                batch_size=4,
                payload_root=payloads,
                collate={"workers": 1 + attempt % 2},
                prefetch=attempt % 3,
            )
            try:
                for batch in batches:
                    for b, i in enumerate(batch.metadata["index"]):
                        got = batch["routed_experts"][b][:5].numpy()
                        np.testing.assert_array_equal(got, expected[i])
                    outcomes["batch"] += 1
            except PayloadHandleError:
                outcomes["refused"] += 1
            except PayloadNotFoundError:
                outcomes["gone"] += 1
            del batches  # a stopped loader's threads are joined here, not by a collection
            python_gc.collect()  # that happens to run on one of them
    finally:
        stop.set()
        swapper.join()
    assert outcomes["batch"] > 0, outcomes
    assert outcomes["refused"] > 0, outcomes
    assert sorted(p.name for p in outside.iterdir()) == names  # nothing outside was touched


@pytest.mark.parametrize("seed", range(3))
def test_a_shuffled_loader_resumed_mid_step_reads_every_file_before_it_is_deleted(tmp_path, seed):
    """Files shared by samples of far apart steps (a shuffled map-style source), micro-batches,
    a crash at a random micro-batch (the trainer restarts from the loader's state with a new
    retention on the same root, as a resumed run does), an update after every step: every
    batch reads (a file deleted early raises), and once the backstop passed nothing is left."""
    rng = random.Random(seed)
    payloads = tmp_path / "payloads"
    writer = PayloadWriter(str(payloads))
    files = []
    for _ in range(10):
        rows = np.random.default_rng(rng.randrange(2**31)).integers(0, 16, (40, 2, 2))
        files.append((writer.write(0, {"routed_experts": rows.astype(np.uint8)})[0], rows))
    samples, expected = [], []
    for i in range(rng.randint(12, 20)):
        segment, rows = rng.choice(files)  # a file named by several samples, any steps
        lo = rng.randrange(0, 35)
        source = shift([segment.clipped(lo, lo + 5)], -lo)[0].to_dict()
        request = {"prompt_len": 3, "completion_len": 3, "sources": [source]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(6), "requests": [request]})
        expected.append(rows[lo : lo + 5])
    options = {
        "batch_size": rng.choice([2, 3, 4]),
        "micro_batches": MicroBatches(size=rng.choice([1, 2])),
        "shuffle": Shuffle(seed=seed),
        "payload_root": payloads,
        "prefetch": rng.choice([0, 2]),
    }
    max_off = rng.choice([0, 1, 3])
    retention = PayloadRetention(str(payloads), max_off, fresh=False)
    batches = loader(samples, retention=retention, **options)
    it, read, crash_at, last_step = iter(batches), 0, rng.randrange(1, len(samples)), 0
    while (batch := next(it, None)) is not None:
        for b, i in enumerate(batch.metadata["index"]):
            np.testing.assert_array_equal(batch["routed_experts"][b][:5].numpy(), expected[i])
            read += 1
        last_step = batch.metadata["step"]
        if batch.metadata["micro_batch"] + 1 == batch.metadata["micro_batches"]:
            retention.on_policy_update(last_step)
            retention.wait()
        if read >= crash_at:  # the trainer dies here and resumes from its checkpoint
            crash_at = len(samples) + 1
            state = batches.state_dict()
            retention.close()
            retention = PayloadRetention(str(payloads), max_off, fresh=False)
            batches = loader(samples, retention=retention, **options)
            batches.load_state_dict(state)
            it = iter(batches)
    assert read == len(samples)
    retention.on_policy_update(last_step + max_off + 1)
    retention.close()
    assert not list(payloads.rglob("*.bin"))


@pytest.mark.parametrize("kind", LOCAL_CLASSES)
def test_retention_never_deletes_through_a_symlink_even_one_inside_the_root(tmp_path, kind):
    """A link inside the root makes a second name of a file (``v1/up -> ..``, ``v2 -> v1``):
    released under that name, the file would go while a later batch still needs it under its
    own. A deletion follows no symlink, inside or out."""
    base, root, fs = planted(tmp_path, kind)
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    payloads, name = base / "payloads", posixpath.basename(segment.file)
    (payloads / "v1" / "up").symlink_to("..")
    (payloads / "v2").symlink_to("v1")
    retention = PayloadRetention(root, 8, fs=fs, fresh=False)
    retention.claim(5, [segment.file])
    retention.claim(2, [f"v1/up/{segment.file}", f"v2/{name}"])
    retention.on_policy_update(2)
    retention.wait()
    assert (payloads / segment.file).exists(), "deleted through a link before step 5 read it"
    assert retention.metrics().delete_errors == 2
    np.testing.assert_array_equal(PayloadReader(root, fs=fs).read([segment])["routes"], ROUTES)
    retention.on_policy_update(5)
    retention.close()
    assert not (payloads / segment.file).exists()
    assert (payloads / "v2").is_symlink()
    assert (payloads / "v1" / "up").is_symlink()


class SwapsAfterListing(LocalFileSystem):
    """Lists a version folder, then swaps it for a link to ``target`` before anyone deletes
    what was listed (the race between a listing and a deletion, made certain)."""

    cachable = False

    def __init__(self, target: Path) -> None:
        super().__init__()
        self.target = target

    def ls(self, path, detail=False, **kwargs):
        listed = super().ls(path, detail=detail, **kwargs)
        if posixpath.basename(path.rstrip("/")) == "v1" and not os.path.islink(path):
            os.rename(path, path + "-moved")
            os.symlink(self.target, path)
        return listed


@pytest.mark.parametrize("target", ["inside", "outside"])
def test_gc_reports_a_folder_swapped_for_a_link_and_goes_on(tmp_path, target):
    """gc lists ``v1``, which becomes a link (to a copy inside the root, or outside) before its
    files are deleted: nothing is deleted through the link, the file is an error of the report,
    and the other versions are still swept."""
    payloads = tmp_path / "payloads"
    writer = PayloadWriter(str(payloads))
    first = writer.write(1, {"routes": ROUTES})[0]
    second = writer.write(2, {"routes": ROUTES})[0]
    copy = payloads / "copy" if target == "inside" else tmp_path / "copy"
    copy.mkdir()
    (copy / posixpath.basename(first.file)).write_bytes((payloads / first.file).read_bytes())
    report = gc(str(payloads), 50, 0, fs=SwapsAfterListing(copy))
    assert list(report.files) == [second.file]
    (error,) = report.errors
    assert error.startswith(f"{first.file}: ")
    assert "symlink" in error
    assert (copy / posixpath.basename(first.file)).exists()
    assert not (payloads / second.file).exists()


@pytest.mark.parametrize("kind", ["LocalFileSystem", "DirFileSystem", "simplecache"])
def test_a_socket_in_the_tree_is_refused_and_listed_unreadable(tmp_path, kind):
    """A socket (bound where its path is short, then moved in) is neither opened nor read."""
    if kind == "simplecache":
        base = tmp_path / "base"
        root, fs = WRAPPERS[kind](base)
    else:
        base, root, fs = planted(tmp_path, kind)
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    short = Path(tempfile.mkdtemp(dir="/tmp"))
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(short / "s"))
        os.rename(short / "s", base / "payloads" / "v1" / "sock.bin")
        short.rmdir()
        with pytest.raises(PayloadHandleError, match="is a socket, not a regular file"):
            PayloadReader(root, fs=fs, retries=0).read([moved(segment, "v1/sock.bin")])
        report = verify(root, fs=fs)
    assert list(report.unreadable) == ["v1/sock.bin"]
    assert report.files_checked == 1


def test_an_object_version_is_no_payload_name_on_any_s3_root():
    """``key?versionId=...`` is read (and deleted) by s3fs as ``key``: a second name of a file.
    Refused before any request, on the store itself and through a DirFileSystem over it."""
    s3fs = pytest.importorskip("s3fs")
    store = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    for root in (
        PayloadRoot("s3://bucket/run", fs=store),
        PayloadRoot("run", fs=DirFileSystem("bucket", store)),
    ):
        for name in ("v1/x.bin?versionId=null", "v1/x.bin?versionId=a/b"):
            with pytest.raises(PayloadHandleError, match=r"names object 'bucket/run/v1/x.bin'"):
                root.relative(name)
            with pytest.raises(PayloadHandleError, match="expected a plain key"):
                root.remove(name)
        assert root.relative("v1/x.bin?v=1") == "v1/x.bin?v=1"  # a plain key with a '?'
        longest = "v1/" + "a" * (1024 - len("run/v1/"))
        assert root.relative(longest) == longest
        with pytest.raises(PayloadHandleError, match="a key of 1025 bytes: expected at most 1024"):
            root.relative(longest + "a")  # no store keeps it: not a missing file to wait for
        with pytest.raises(PayloadHandleError, match="must be a path in utf-8"):
            root.relative("v1/\udcff.bin")


def test_a_file_cut_and_regrown_under_a_reader_gives_its_bytes_or_a_typed_error(tmp_path):
    """Another thread truncates a file in place (halfway, or to nothing) and writes it back,
    again and again, while a reader without checksums to hide behind reads it through every
    entry point: each read is the file's bytes exactly, or a short read or a claim past the
    end, never a zero-filled tail."""
    root = tmp_path / "payloads"
    data = np.random.default_rng(4).integers(1, 256, (4000, 48, 8)).astype(np.uint8)
    (segment,) = PayloadWriter(str(root)).write(1, {"routes": data})
    unchecked = PayloadSegment(**{**segment.to_dict(), "crc32c": None})
    path, whole = root / segment.file, (root / segment.file).read_bytes()
    stop = threading.Event()

    def cut_and_regrow() -> None:
        sizes = [len(whole) // 2, 0, segment.offset + 100]
        i = 0
        while not stop.is_set():
            with open(path, "r+b") as f:
                f.truncate(sizes[i % len(sizes)])
                time.sleep(0.0005)
                f.seek(0)
                f.write(whole)
            time.sleep(0.0005)
            i += 1

    cutter = threading.Thread(target=cut_and_regrow)
    cutter.start()
    reader = PayloadReader(str(root), retries=1, backoff=0.0, max_backoff=0.0)
    outcomes = {"read": 0, "short": 0}
    try:
        for i in range(150):
            out = np.zeros_like(data)
            try:
                if i % 2:
                    reader.read_into([unchecked], out)
                else:
                    out = reader.read([unchecked])["routes"]
            except (PayloadReadError, SegmentError) as exc:
                message = str(exc)
                outcomes["short"] += 1
                if "short read" in message or "claims bytes up to" in message:
                    continue
                raise
            np.testing.assert_array_equal(out, data)
            outcomes["read"] += 1
    finally:
        stop.set()
        cutter.join()
    assert outcomes["read"] > 0, outcomes
    assert outcomes["short"] > 0, outcomes


@pytest.mark.parametrize("kind", ["LocalFileSystem", "DirFileSystem(DirFileSystem)"])
def test_without_openat2_the_symlink_and_swapping_campaigns_hold(tmp_path, kind, monkeypatch):
    """Kernels before 5.6, and containers whose seccomp profile refuses ``openat2``, open
    plainly and judge the descriptor's own path: the same outcomes, link for link."""
    monkeypatch.setattr(payload_fs, "_openat2_missing", True)
    base, root, fs = planted(tmp_path, kind)
    data = np.random.default_rng(8).integers(0, 256, (40, 48, 8)).astype(np.uint8)
    (segment,) = PayloadWriter(root, fs=fs).write(1, {"routes": data})
    (base / "payloads" / segment.file).rename(base / "payloads" / "v1" / "a.bin")
    inside = moved(segment, "v1/a.bin")
    plant_hostile_tree(base, bytes(inside.offset + inside.nbytes))
    counts = symlink_campaign(root, fs, str(base / "payloads"), inside, random.Random(kind), 300)
    assert min(counts.values()) > 10, counts
    (swapped,) = PayloadWriter(root, fs=fs).write(2, {"routes": data})
    counts = swapping_tree_campaign(root, fs, base, swapped, data, 300)
    assert counts["read"] > 0, counts
    assert counts["refused"] > 0, counts
    with PayloadRetention(root, 0, fs=fs, fresh=False) as retention:  # deletions too
        retention.claim(0, ["v9/a.bin", "v1/etc/passwd", "v1/abs_out.bin", "v1/up/v1/a.bin"])
        retention.on_policy_update(3)
    assert (base / "outside" / "v1" / "a.bin").exists()
    assert (base / "outside" / "passwd").exists()
    assert payload_fs._openat2_missing


@pytest.mark.parametrize("openat2", [True, False])
def test_links_to_proc_magic_links_are_refused(tmp_path, openat2, monkeypatch):
    """A link to ``/proc/self/fd/N`` (a file this process holds open outside the root, a pipe)
    or ``/proc/self/cwd`` is judged by where the kernel resolves it: outside, refused."""
    monkeypatch.setattr(payload_fs, "_openat2_missing", not openat2)
    root = tmp_path / "payloads"
    segment = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    secret = tmp_path / "secret.bin"
    secret.write_bytes((root / segment.file).read_bytes())
    held = os.open(secret, os.O_RDONLY)
    pipe_read, pipe_write = os.pipe()
    try:
        links = {
            "held.bin": f"/proc/self/fd/{held}",
            "pipe.bin": f"/proc/self/fd/{pipe_read}",
            "cwd.bin": f"/proc/self/cwd/{os.path.relpath(secret)}",
            "again.bin": "held.bin",
        }
        for name, target in links.items():
            (root / "v1" / name).symlink_to(target)
        reader = PayloadReader(str(root), retries=0)
        for name in links:
            with pytest.raises(PayloadHandleError, match="outside the root"):
                reader.read([moved(segment, f"v1/{name}")])
    finally:
        for fd in (held, pipe_read, pipe_write):
            os.close(fd)


@pytest.mark.parametrize("root", ["", "/"])
def test_a_whole_dirfilesystem_as_the_root_is_listed_verified_and_retained(tmp_path, root):
    """A ``DirFileSystem`` lists its top's files without a leading slash: they are inside the
    root all the same (else verify fails and retention never deletes anything)."""
    fs = DirFileSystem(str(tmp_path), LocalFileSystem())
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    report = verify(root, fs=fs)
    assert (report.files_checked, report.ok) == (1, True)
    with PayloadRetention(root, 0, fs=fs, fresh=False) as retention:
        retention.claim(0, [segment.file])
        retention.on_policy_update(0)
    assert retention.metrics().files_deleted == 1
    assert not (tmp_path / segment.file).exists()
    PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})
    assert gc(root, 5, 0, fs=fs).files
    assert not list(tmp_path.rglob("*.bin"))


def test_a_writer_racing_a_version_folder_swapped_for_a_link_never_writes_outside(tmp_path):
    """While another thread swaps ``v3`` between the real folder and a link out of the root,
    each write lands in the real folder or fails with a typed error; nothing appears outside."""
    payloads, outside = tmp_path / "payloads", tmp_path / "outside"
    writer = PayloadWriter(str(payloads))
    writer.write(3, {"routes": ROUTES})
    outside.mkdir()
    (payloads / "v3").rename(payloads / ".v3-real")
    (payloads / "v3").symlink_to(".v3-real")
    stop = threading.Event()

    def swap() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            link = payloads / f".v3-link-{i % 2}"
            link.symlink_to(".v3-real" if i % 2 else str(outside))
            os.replace(link, payloads / "v3")
            time.sleep(0.0002)

    swapper = threading.Thread(target=swap)
    swapper.start()
    written, refused = [], 0
    try:
        for _ in range(200):
            try:
                written.append(writer.write(3, {"routes": ROUTES[:2]})[0].file)
            except PayloadWriteError as exc:
                if "outside the root" not in str(exc):
                    raise
                refused += 1
    finally:
        stop.set()
        swapper.join()
    assert list(outside.iterdir()) == []
    real = payloads / ".v3-real"
    assert all((real / posixpath.basename(f)).is_file() for f in written)
    assert written, refused
    assert refused, len(written)


def test_permission_changes_as_an_unprivileged_user(tmp_path):
    """As ``nobody``: a file made unreadable is a permission error at once (not retried); one
    made unreadable after its size check still reads through the descriptor kept from it; a
    file in a folder it may not write stays, counted as a failed deletion."""
    if os.geteuid() != 0:
        pytest.skip("switching to nobody needs root")
    root = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(root, 0o777)
        os.mkdir(os.path.join(root, "v2"), 0o755)
        Path(root, "v2", "root.bin").write_bytes(b"root's")
        context = forkserver()  # a fork of this process would inherit the pool's dead threads
        parent, child = context.Pipe(duplex=False)
        process = context.Process(target=permission_checks_as_nobody, args=(root, child))
        process.start()
        process.join(60)
        assert process.exitcode == 0, "the child failed (its traceback is above)"
        found = parent.recv()
        message, seconds = found["denied"]
        assert "may not be read" in message
        assert seconds < 0.5
        assert found["kept"]
        assert found["delete_errors"] == 1
        assert Path(root, "v2", "root.bin").exists()
    finally:
        shutil.rmtree(root)


@pytest.mark.parametrize("kind", ["path", "DirFileSystem"])
def test_a_root_with_dotdot_after_a_symlink_is_the_folder_the_kernel_resolves(tmp_path, kind):
    """``link/../run`` is ``<link's target>/../run`` to the kernel and to fsspec's listings, not
    the lexical ``run`` beside ``link``: reads, writes and deletions go where the listing
    looks (a lexical one listed the kernel's folder and deleted its names in the other one)."""
    (tmp_path / "real" / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "a")
    spelled = str(tmp_path / "link" / ".." / "run")
    root, fs = (
        (spelled, None) if kind == "path" else ("", DirFileSystem(spelled, LocalFileSystem()))
    )
    segment = PayloadWriter(root, fs=fs).write(1, {"routes": ROUTES})[0]
    resolved, lexical = tmp_path / "real" / "run", tmp_path / "run"
    assert (resolved / segment.file).is_file()
    (lexical / "v1").mkdir(parents=True)  # another run's file under the same name
    (lexical / segment.file).write_bytes(b"another run's file")
    np.testing.assert_array_equal(PayloadReader(root, fs=fs).read([segment])["routes"], ROUTES)
    assert verify(root, fs=fs).ok
    assert gc(root, 5, 0, fs=fs).files == [segment.file]
    assert not (resolved / segment.file).exists()
    assert (lexical / segment.file).read_bytes() == b"another run's file"


def test_a_released_name_that_cannot_exist_is_gone_not_retried_forever(tmp_path):
    """A hostile handle is claimed before the read refuses it: a folder (``v1``), a name under
    a file (``v1/x.bin/y``) or one too long for the filesystem names no file, so its release is
    done at once (the folder stays), not a deletion failing (logged, counted, kept pending) at
    every update."""
    root = tmp_path / "payloads"
    segment = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    names = ["v1", f"{segment.file}/y.bin", "v1/" + "a" * 300, "v1/" + "a/" * 3000 + "x.bin"]
    with PayloadRetention(str(root), 4, fresh=False) as retention:
        retention.claim(0, names)
        for step in range(3):
            retention.on_policy_update(step)
            retention.wait()
            metrics = retention.metrics()
            assert (metrics.files_pending, metrics.delete_errors) == (0, 0), step
    assert (root / segment.file).is_file()
