"""Hostile handles and filesystem classes beyond the campaigns: every spelling of a way out,
wrappers over a local filesystem (caches, async adapters), and classes no check can confine."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from payload_campaigns import LOCAL_CLASSES, local_classes, moved

from r3data.errors import (
    ConfigError,
    PayloadHandleError,
    PayloadNotFoundError,
    R3DataError,
    SegmentError,
)
from r3data.payload import PayloadReader, PayloadRetention, PayloadRoot, PayloadWriter

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
def test_roots_no_check_can_confine_are_refused(make):
    """An HTTP client percent-decodes ``%2e%2e`` and removes the dot segments (a handle
    ``v1/%2e%2e/%2e%2e/secret`` reads ``/secret`` of the server), so no root there is safe."""
    pytest.importorskip("aiohttp")
    root, fs = make()
    for build in (PayloadRoot, lambda r, f: PayloadReader(r, fs=f)):
        with pytest.raises(ConfigError, match=r"reads HTTP URLs.*expected a local path"):
            build(root, fs)


def test_object_store_like_roots_stay_accepted():
    """The refusal is by class, not a blanket one: memory and S3 roots are confined lexically."""
    assert not PayloadRoot(f"memory://r3-hostile-{uuid.uuid4().hex}").local_backed
    pytest.importorskip("s3fs")
    assert not PayloadRoot("s3://bucket/run", fs=fsspec.filesystem("s3", anon=True)).local_backed


def test_a_name_fsdecode_made_reads_that_file(tmp_path):
    """A handle holding ``os.fsdecode``'s escapes of non-UTF-8 bytes names that file."""
    root = tmp_path / "payloads"
    segment = PayloadWriter(str(root)).write(1, {"routes": ROUTES})[0]
    name = os.fsdecode(b"v1/\xff.bin")
    os.rename(root / segment.file, os.fsencode(str(root)) + b"/v1/\xff.bin")
    got = PayloadReader(str(root), retries=0).read([moved(segment, name)])["routes"]
    np.testing.assert_array_equal(got, ROUTES)
