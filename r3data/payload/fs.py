"""A payload root on any fsspec filesystem, and the rule that no handle resolves outside it.

Handles come from inference servers over the network. Each one is first resolved lexically (no
``..`` above the root, no absolute path or URL elsewhere; on an object store, a plain key).
Roots on filesystems whose paths no such check confines (HTTP, fsspec's generic filesystem)
are refused. On a *local-backed* root (any filesystem whose paths are OS paths:
``LocalFileSystem``, its subclasses, a ``DirFileSystem``, a cache or an async adapter over
one) every open, directory and deletion then goes through the kernel: the path is opened
relative to a fresh descriptor of the root (or one plan's, :meth:`PayloadRoot.held`) with
``openat2(RESOLVE_BENEATH)``, which refuses any resolution that leaves it; what it refuses
(an absolute symlink, which may still lead inside), what it cannot decide (``EAGAIN``: a
rename anywhere on the machine raced a ``..``) and everything on kernels without ``openat2``
is opened plainly, and the descriptor's own path, symlinks resolved as the kernel holds it,
must then lie inside the root's and, walked beneath the root following no symlink, name the
same inode (a magic link into another mount namespace shows a path as that namespace sees
it), so nothing is remembered beyond one plan that a rename or a swapped symlink could
invalidate. A file is opened
``O_PATH`` first and must be a regular file before it is opened to read, so a FIFO cannot
block a read and a device is never opened. Nothing beneath the root is read or deleted across a
mount point (``RESOLVE_NO_XDEV``, else the mount id): a bind mount would give files a second
name, or open a window outside the root. A deletion follows no symlink at all, so that no
file has a second name whose release deletes it. This needs Linux's ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import posixpath
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from operator import methodcaller
from typing import Any, BinaryIO

import fsspec
import numpy as np
from fsspec import AbstractFileSystem
from fsspec.implementations.cache_mapper import HashCacheMapper
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from r3data.errors import (
    ConfigError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
)
from r3data.payload.deadline import (
    DEFAULT_TIMEOUT_S,
    bounded,
    checked_timeout,
    on_event_loop,
    within,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PayloadFile",
    "PayloadRoot",
    "checked_timeout",
    "local_path",
    "open_file",
]

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_ROOT = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_PATH = os.O_PATH | os.O_CLOEXEC  # names an inode: opens nothing, so blocks on nothing
_READ = os.O_RDONLY | os.O_CLOEXEC
_FORMAT_BITS = 0o170000  # the file-type bits of ``st_mode`` (what ``stat.S_IFMT`` keeps)
_FILE_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
}


_PASS_THROUGH: dict[type[AbstractFileSystem], str] = {CachingFileSystem: "fs"}
"""Wrappers that read through another filesystem with the same paths -> the attribute
holding it."""
with contextlib.suppress(ImportError):  # fsspec >= 2024.12
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    _PASS_THROUGH[AsyncFileSystemWrapper] = "sync_fs"

_HTTP = (
    "HTTP URLs, which no check confines to the root (the client percent-decodes '%2e%2e' and "
    "removes dot segments; a query or fragment names another resource)"
)
_UNCONFINABLE = {
    "http": _HTTP,
    "https": _HTTP,
    "generic": "URLs of any filesystem a path names, opened by that one (a local one follows "
    "symlinks out of the root)",
}
"""Protocols whose paths no lexical check confines -> why."""


def _wrapped(fs: AbstractFileSystem) -> AbstractFileSystem | None:
    """The filesystem that ``fs`` reads through with the same paths (a cache, an async
    adapter), else None: a wrapper over a local filesystem opens OS paths, following
    symlinks, so it is confined as that filesystem is."""
    for wrapper, attribute in _PASS_THROUGH.items():
        if isinstance(fs, wrapper):
            return getattr(fs, attribute)
    return None


def _layers(fs: AbstractFileSystem, path: str) -> Iterator[tuple[AbstractFileSystem, str]]:
    """``(fs, path)``, then each filesystem it reads through (a ``DirFileSystem``'s target, a
    wrapper's) with the path as that one names it; the last is the one that opens files."""
    layer: AbstractFileSystem | None = fs
    while layer is not None:
        yield layer, path
        if isinstance(layer, DirFileSystem):
            layer, path = layer.fs, layer._join(path)
        else:
            layer = _wrapped(layer)


def local_path(fs: AbstractFileSystem, path: str) -> str | None:
    """The OS path that ``path`` names in ``fs`` when ``fs`` is local-backed (through any
    ``dir://`` or wrapping layers), else None: the calls that need no deadline."""
    *_, (inner, inner_path) = _layers(fs, path)
    if isinstance(inner, LocalFileSystem):
        return _os_form(inner._strip_protocol(inner_path))
    return None


def _os_form(path: str) -> str:
    """``path`` without empty or ``.`` parts but with every ``..``: after a symlink the kernel
    (and a listing) resolves ``link/..`` to the link's target's parent, so ``normpath``'s
    lexical ``..`` would name another folder than the one the filesystem lists."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    return ("/" if path.startswith("/") else "") + "/".join(parts) or "."


MAX_KEY_BYTES = 1024
"""The longest object key S3, GCS and Azure Blob Storage keep, in UTF-8 bytes."""


def _key_problem(fs: AbstractFileSystem, path: str) -> str | None:
    """Why an object store's client (one with ``split_path``: s3fs, gcsfs, adlfs) reads no
    plain key ``path``: it reads another object (s3fs drops ``?versionId=...`` or reads that
    version), or the key is longer than any store keeps (S3, GCS and Azure: 1024 bytes, so
    no writer can ever publish it), or it holds a backslash (SeaweedFS and S3 gateways over
    a filesystem read it as ``/``: a second name of another key); else None."""
    *_, (inner, inner_path) = _layers(fs, path)
    split = getattr(inner, "split_path", None)
    if split is None:
        return None
    bucket, key, *version = split(inner_path)
    whole = f"{bucket}/{key}" if key else bucket
    if whole != inner._strip_protocol(inner_path).lstrip("/") or any(version):
        found = repr(whole) + "".join(f" version {v!r}" for v in version if v)
        return f"names object {found}: expected a plain key (no version or query)"
    if "\\" in key:
        return (
            f"names key {key!r} with a backslash, which some stores read as '/' (another "
            "key's second name): expected '/' between the parts"
        )
    if len(key.encode()) > MAX_KEY_BYTES:
        return f"names a key of {len(key.encode())} bytes: expected at most {MAX_KEY_BYTES}"
    return None


def _whole(path: str) -> str:
    """``path`` with one leading slash and none trailing: how a root and a listing compare."""
    return "/" + path.strip("/")


def _check_confinable(fs: AbstractFileSystem, root: str) -> None:
    """Refuse (:class:`ConfigError`) a root on a filesystem, or a wrapper of one, whose paths
    no check confines (:data:`_UNCONFINABLE`), or read through a cache that may serve one
    file's copy for another's (a local-backed root's opens are the kernel's: no cache's)."""
    layers = [layer for layer, _ in _layers(fs, "")]
    read_through = not isinstance(layers[-1], LocalFileSystem)  # local-backed: os opens
    for layer in layers:
        protocols = (layer.protocol,) if isinstance(layer.protocol, str) else layer.protocol
        why = next((_UNCONFINABLE[p] for p in protocols if p in _UNCONFINABLE), None)
        mapper = getattr(layer, "_mapper", None) if isinstance(layer, CachingFileSystem) else None
        if read_through and mapper is not None and not isinstance(mapper, HashCacheMapper):
            raise ConfigError(
                f"payload root {root}: {type(layer).__name__} names its cached copies with "
                f"{type(mapper).__name__}, which can give two files one copy (same_names=True "
                "names them by base name: v1/x.bin read as v2/x.bin); expected the default, a "
                "hash of each whole path"
            )
        if why is not None:
            raise ConfigError(
                f"payload root {root}: {type(fs).__name__} reads {why}; expected a local path, "
                "a local-backed filesystem or an object store"
            )


def _read_into(f: Any, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``f`` from ``offset`` (fewer at its end), in a buffer of their own (not
    zeroed first: what comes back is what the read filled)."""
    f.seek(offset)
    buffer = np.empty(nbytes, np.uint8)
    return buffer[: f.readinto(memoryview(buffer)) or 0]  # a view: what files are handed


def _land(dest: memoryview, data: Any) -> None:
    """Copy ``data`` (bytes, or a byte array) to the start of ``dest`` with numpy, which copies
    with the GIL released: lanes landing chunks at once copy in parallel."""
    np.copyto(np.frombuffer(dest, np.uint8, len(data)), np.frombuffer(data, np.uint8))


class PayloadFile:
    """A payload file open for reading: ``url`` (for messages), ``size`` at open time, and
    ``fd``, an OS descriptor to ``os.preadv`` on when the file is local-backed (else None)."""

    url: str
    size: int
    fd: int | None = None

    def read_at(self, offset: int, dest: memoryview) -> int:
        """Read up to ``len(dest)`` bytes at ``offset`` into ``dest``; fewer only at the end of
        the file, 0 at or past it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the file; a second call does nothing."""

    def stream(self, buffer_bytes: int) -> BinaryIO:
        """This file as a seekable binary stream read ``buffer_bytes`` at a time (for the header
        parser)."""
        return io.BufferedReader(_Stream(self), buffer_bytes)  # type: ignore[return-value]

    def __enter__(self) -> PayloadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, size={self.size})"


class _Stream(io.RawIOBase):
    """An open :class:`PayloadFile` as a seekable raw stream."""

    def __init__(self, file: PayloadFile) -> None:
        self.file, self.at = file, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.file.size}[whence]
        self.at = base + offset
        return self.at

    def readinto(self, buffer: Any) -> int:
        n = self.file.read_at(self.at, memoryview(buffer).cast("B"))
        self.at += n
        return n


class LocalPayloadFile(PayloadFile):
    """A local-backed payload file, read with ``os.preadv`` on its descriptor."""

    def __init__(self, fd: int, url: str, size: int | None = None) -> None:
        self.fd, self.url = fd, url
        self.size = os.fstat(fd).st_size if size is None else size

    def read_at(self, offset: int, dest: memoryview) -> int:
        if self.fd is None:
            raise PayloadReadError(f"reading {self.url}: the file was closed")
        try:
            return os.preadv(self.fd, [dest], offset)
        except OSError as exc:
            raise PayloadReadError(f"reading {self.url} at offset {offset}: {exc}") from exc

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class FsspecPayloadFile(PayloadFile):
    """A payload file on any other fsspec filesystem, read without a read cache: each read is
    one ranged request (one ranged GET on an object store), and a small read never fetches the
    block around it. Each call to the filesystem is given up after ``timeout`` seconds
    (:data:`DEFAULT_TIMEOUT_S`; None: no limit). On an event-loop filesystem (s3fs and the
    like) a read is the filesystem's own ranged ``cat_file`` (of the object version seen at open
    on a version-aware s3fs), cancelled at its deadline; on any other it goes through a file
    opened once, and with a timeout lands in a buffer of its own before it is copied into the
    caller's, so that a read abandoned at its deadline can never write into the caller's buffer
    later."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        info: dict[str, Any],
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.url = fs.unstrip_protocol(path)
        self.size = int(info.get("size") or 0)
        self.fs, self.path, self.timeout = fs, path, timeout
        self.closed = False
        self.f: Any = None
        self._version = _pinned_version(fs, info)
        if on_event_loop(fs, "cat_file") is None:
            doing = f"opening {self.url}"
            with _fsspec_errors(self.url, doing):
                self.f = within(
                    timeout,
                    doing,
                    partial(fs.open, path, "rb", cache_type="none", size=self.size),
                    fs,
                    late=methodcaller("close"),
                )
            if isinstance(self.f, AbstractBufferedFile):
                self.f.details = info  # what open would look up again (one more HEAD on S3)

    def read_at(self, offset: int, dest: memoryview) -> int:
        if self.closed:
            raise PayloadReadError(f"reading {self.url}: the file was closed")
        wanted = min(len(dest), self.size - offset)
        if wanted <= 0:
            return 0
        doing = f"reading {self.url} at offset {offset}"
        with _fsspec_errors(self.url, doing):
            if self.f is None:
                data = bounded(
                    self.fs,
                    self.timeout,
                    doing,
                    "cat_file",
                    self.path,
                    start=offset,
                    end=offset + wanted,
                    **self._version,
                )
            elif self.timeout is None:
                self.f.seek(offset)
                return self.f.readinto(dest) or 0
            else:
                data = within(
                    self.timeout, doing, partial(_read_into, self.f, offset, wanted), self.fs
                )
        if len(data) > wanted:
            raise PayloadReadError(
                f"{doing}: asked for {wanted} bytes, the filesystem returned {len(data)}"
            )
        _land(dest, data)
        return len(data)

    def close(self) -> None:
        self.closed = True
        f, self.f = self.f, None
        if f is None or f.closed:
            return
        if isinstance(f, AbstractBufferedFile) or self.timeout is None:
            f.close()  # a buffered file open to read closes without a request
            return
        with contextlib.suppress(PayloadReadError):  # past its deadline: left to its thread
            within(self.timeout, f"closing {self.url}", f.close, self.fs)


def _pinned_version(fs: AbstractFileSystem, info: dict[str, Any]) -> dict[str, str]:
    """``{"version_id": ...}``, the object version ``info`` describes, when ``fs`` reads
    through a version-aware s3fs (``S3FileSystem(version_aware=True)``): every ranged read of
    the file then reads the version its open looked at, as s3fs's own files do; else ``{}``."""
    *_, (inner, _) = _layers(fs, "")
    version = info.get("VersionId")
    if version and getattr(inner, "version_aware", False):
        return {"version_id": version}
    return {}


@contextlib.contextmanager
def _fsspec_errors(url: str, doing: str) -> Iterator[None]:
    """Map what a filesystem raises (an ``OSError``, or a client library's own exception such as
    botocore's connection errors) onto the payload error classes."""
    try:
        yield
    except FileNotFoundError as exc:
        raise PayloadNotFoundError(f"payload file {url} does not exist") from exc
    except PermissionError as exc:
        raise PayloadPermissionError(
            f"payload file {url} may not be read (check the credentials or permissions): {exc}"
        ) from exc
    except PayloadReadError:
        raise
    except Exception as exc:  # a client library's own errors are I/O failures here
        raise PayloadReadError(f"{doing}: {type(exc).__name__}: {exc}") from exc


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE_BENEATH_ONLY = 0x01 | 0x02 | 0x08  # RESOLVE_NO_XDEV | NO_MAGICLINKS | BENEATH
_RESOLVE_NO_SYMLINKS = 0x04
_openat2_missing = sys.platform != "linux"
_HOWS: dict[tuple[int, int], Any] = {}  # (flags, resolve) -> a by-reference ``open_how``


def _openat2(
    root_fd: int, rel: str, flags: int, resolve: int = _RESOLVE_BENEATH_ONLY
) -> int | None:
    """``openat2(root_fd, rel, flags, resolve)``, by default ``RESOLVE_BENEATH``: the kernel
    refuses (``EXDEV``) any resolution leaving ``root_fd``; None on a kernel without the call."""
    global _openat2_missing
    if _openat2_missing:
        return None
    how = _HOWS.get((flags, resolve))
    if how is None:
        how = _HOWS[flags, resolve] = ctypes.byref(_OpenHow(flags, 0, resolve))
    fd = _LIBC.syscall(_SYS_OPENAT2, root_fd, rel.encode(_FS_ENCODING, _FS_ERRORS), how, 24)
    if fd >= 0:
        return fd
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EPERM) and not _probe_openat2():
        _openat2_missing = True
        return None
    raise OSError(code, os.strerror(code), rel)


def _probe_openat2() -> bool:
    """Whether ``openat2`` works here at all (seccomp filters may refuse it)."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, 0)
    fd = _LIBC.syscall(_SYS_OPENAT2, -100, b"/", ctypes.byref(how), 24)  # AT_FDCWD
    if fd >= 0:
        os.close(fd)
        return True
    return False


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
"""How ``os.fsencode`` turns a path into bytes."""


def _fd_path(fd: int) -> str:
    """Where the open descriptor ``fd`` lives now, symlinks resolved, as the kernel holds it."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _mount_id(fd: int) -> int:
    """The id of the mount ``fd`` lies on: a bind mount has its own, even of the root's own
    filesystem (``st_dev`` would not tell it apart)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
        for line in info:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in /proc/self/fdinfo", str(fd))


def _mount_refusal(what: str, url: str) -> PayloadHandleError:
    return PayloadHandleError(
        f"{what} lies on another mount than the payload root {url}: expected one mount beneath "
        "the root (a mount point beneath it gives files a second name, or a window outside it)"
    )


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _walk_no_symlinks(root_fd: int, rel: str, flags: int) -> int:
    """``rel`` (normalised, no ``..``) opened with ``flags`` beneath ``root_fd``, one name at a
    time, following no symlink (one on the way: ``ELOOP`` or ``ENOTDIR``)."""
    at, parts = root_fd, rel.split("/")
    try:
        for part in parts[:-1]:
            inner = os.open(part, _PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=at)
            if at != root_fd:
                os.close(at)
            at = inner
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=at)
        if stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH | O_NOFOLLOW opens the link itself
            os.close(fd)
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)
        return fd
    finally:
        if at != root_fd:
            os.close(at)


def _symlink_on_way(root_fd: int, rel: str) -> str | None:
    """The first name on ``rel``'s way beneath ``root_fd`` (a folder of it, or it) that is a
    symlink, else None: what a walk following none (:func:`_walk_no_symlinks`) stopped at."""
    parts = rel.split("/")
    for end in range(1, len(parts) + 1):
        try:
            if stat.S_ISLNK(os.lstat("/".join(parts[:end]), dir_fd=root_fd).st_mode):
                return parts[end - 1]
        except OSError:
            return None
    return None


def _names_inode_of(fd: int, root_fd: int, rel: str) -> bool:
    """Whether ``rel``, walked beneath ``root_fd`` following no symlink, names the inode ``fd``
    holds. The kernel's path of a descriptor (:func:`_fd_path`) is the one its own mount
    namespace sees: through a magic link (``/proc/PID/root/...``) a file of another namespace
    can show a path inside the root that here names another file, or none."""
    try:
        found_fd = _walk_no_symlinks(root_fd, rel, _PATH) if rel else os.dup(root_fd)
    except OSError:
        return False
    try:
        found, want = os.fstat(found_fd), os.fstat(fd)
    finally:
        os.close(found_fd)
    return (found.st_dev, found.st_ino) == (want.st_dev, want.st_ino)


def _regular_size(fd: int, what: Callable[[], str]) -> int:
    """The size of the regular file ``fd`` holds; anything else is refused (``what()`` names
    it)."""
    st = os.fstat(fd)
    kind = st.st_mode & _FORMAT_BITS
    if kind != stat.S_IFREG:
        kind_name = _FILE_KINDS.get(kind, "special file")
        raise PayloadHandleError(f"{what()} is a {kind_name}, not a regular file")
    return st.st_size


def _reopen_to_read(path_fd: int) -> int:
    """A readable descriptor of the very inode ``path_fd`` (an ``O_PATH`` descriptor) holds."""
    return os.open(f"/proc/self/fd/{path_fd}", _READ)


def _local_error(exc: OSError, url: str, what: str) -> Exception:
    """The payload error an OS error of an open stands for; ``what`` names the file (and the
    handle)."""
    if isinstance(exc, FileNotFoundError):
        return PayloadNotFoundError(f"payload file {url} does not exist")
    if isinstance(exc, NotADirectoryError):
        return PayloadNotFoundError(f"payload file {url} does not exist: {exc}")
    if isinstance(exc, PermissionError):
        return PayloadPermissionError(f"payload file {url} may not be read: {exc}")
    if exc.errno == errno.ELOOP:
        return PayloadHandleError(f"{what} loops through symlinks")
    if exc.errno == errno.ENAMETOOLONG:  # the name, not the filesystem: no retry helps
        return PayloadHandleError(f"{what} names a path longer than the filesystem allows")
    return PayloadReadError(f"opening payload file {url}: {exc}")


def open_file(
    path: str | os.PathLike[str],
    fs: AbstractFileSystem | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> PayloadFile:
    """Open one file a user named (a path or fsspec URL; no root confines it) for reading.

    A FIFO, device or directory is refused (:class:`PayloadHandleError`) before any open that
    could block on it; a missing file raises :class:`PayloadNotFoundError`. ``timeout`` bounds
    each call to a filesystem that is not local-backed (:data:`DEFAULT_TIMEOUT_S`).
    """
    timeout = checked_timeout(timeout)
    shown = os.fspath(path)
    if fs is None:
        fs, inner = fsspec.core.url_to_fs(shown)
    else:
        inner = fs._strip_protocol(shown)
    os_path = local_path(fs, inner)
    if os_path is None:
        return _open_fsspec(fs, inner, shown, timeout)
    try:
        path_fd = os.open(os_path, _PATH)
        try:
            size = _regular_size(path_fd, lambda: shown)
            return LocalPayloadFile(_reopen_to_read(path_fd), shown, size)
        finally:
            os.close(path_fd)
    except OSError as exc:
        raise _local_error(exc, shown, shown) from exc


def _open_fsspec(
    fs: AbstractFileSystem, path: str, what: str, timeout: float | None
) -> FsspecPayloadFile:
    """``what`` names the file (and the handle) in messages."""
    url = fs.unstrip_protocol(path)
    fs.invalidate_cache(path)  # a listing cached before the file was published must not hide it
    doing = f"opening {url}"
    with _fsspec_errors(url, doing):
        info = bounded(fs, timeout, doing, "info", path)
    if info.get("type") != "file":
        raise PayloadHandleError(f"{what} is a {info.get('type')}, not a regular file")
    return FsspecPayloadFile(fs, path, info, timeout)


class PayloadRoot:
    """Where payload files live: ``fs`` and the ``path`` of the root inside it.

    ``root`` is a local path or any fsspec URL (``memory://r3``, ``s3://bucket/run``); pass
    ``fs`` to use an already configured filesystem (credentials, endpoint), ``root`` then being
    a path inside it. ``local_backed`` tells whether its paths are OS paths (then reads use
    ``os.preadv``, writes are renamed into place, and symlinks are confined by the kernel).
    On any other filesystem each call (an open's look-up, a ranged read, a listing, a
    deletion) is given up after ``timeout`` seconds (:data:`DEFAULT_TIMEOUT_S`; None: no
    limit) as :class:`PayloadReadError`; a local-backed root's calls are system calls, bounded
    by the mount's own options (an NFS mount's ``timeo``/``retrans``, ``soft``).
    ``follow_symlinks=False`` refuses any symlink beneath a local-backed root, even one that
    stays inside it, so that every file has one name (what a retention, deleting files by the
    names claimed for them, needs; the loader's reader is made so when it has one).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fs: AbstractFileSystem | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        follow_symlinks: bool = True,
    ) -> None:
        self.timeout = checked_timeout(timeout)
        self.follow_symlinks = follow_symlinks
        if fs is None:
            fs, path = fsspec.core.url_to_fs(os.fspath(root))
        else:
            path = fs._strip_protocol(os.fspath(root))
        _check_confinable(fs, os.fspath(root))
        self.fs: AbstractFileSystem = fs
        self.path: str = path.rstrip("/") or fs.root_marker or "/"
        self._prefix = _whole(self.path).rstrip("/") + "/"
        try:
            self._os_path = local_path(fs, self.path)
        except ValueError as exc:  # a DirFileSystem refuses a path leaving its folder
            raise ConfigError(
                f"payload root {os.fspath(root)}: expected a path inside {type(fs).__name__}'s "
                f"folder, found one leaving it ({exc})"
            ) from exc
        self._os_dir = None if self._os_path is None else posixpath.join(self._os_path, "")
        self.local_backed: bool = self._os_path is not None

    def __repr__(self) -> str:
        return f"PayloadRoot({self.url!r})"

    @property
    def url(self) -> str:
        """The root as a user would write it: an OS path, or a URL on any other filesystem."""
        return self._os_path if self._os_path is not None else self.fs.unstrip_protocol(self.path)

    def url_of(self, name: str) -> str:
        """The root-relative ``name`` as a user would write it (for messages)."""
        if self._os_path is not None:
            return posixpath.join(self._os_path, name)
        return self.fs.unstrip_protocol(posixpath.join(self.path, name))

    def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(path, *args, **kwargs)`` (a listing, a look-up, a deletion), given up
        after the root's ``timeout`` when the root is not local-backed: then raised as
        :class:`PayloadReadError` naming ``path`` (a ``FileNotFoundError`` or
        ``PermissionError`` the filesystem raises is raised as it is)."""
        if self._os_path is not None:
            return getattr(self.fs, method)(path, *args, **kwargs)
        doing = f"{method} of {self.fs.unstrip_protocol(path)}"
        return bounded(self.fs, self.timeout, doing, method, path, *args, **kwargs)

    def require(self) -> None:
        """Raise :class:`PayloadNotFoundError` when the root does not exist.

        On an object store a prefix holding no object is an empty root, provided its bucket
        exists: stores differ in whether they still list an emptied prefix.
        """
        self.fs.invalidate_cache(self.path)
        if self.call("exists", self.path):
            return
        bucket = self.path.split("/", 1)[0]
        if not self.local_backed and not self.fs.root_marker and self.call("exists", bucket):
            return
        raise PayloadNotFoundError(f"payload root {self.url} does not exist")

    def relative(self, handle: str) -> str:
        """``handle`` as a normalised path relative to the root; refuses one that escapes it.

        A handle may be relative to the root, or name the root's own path: ``/data/run/v1/x.bin``
        and, on an object store, ``bucket/run/v1/x.bin`` or ``s3://bucket/run/v1/x.bin``. On an
        object store it must name a plain key: s3fs reads ``key?versionId=...`` as ``key``, a
        second name whose release would delete a file a later batch reads under the first.
        """
        rel = self._lexically_relative(handle)
        if self._os_path is None:
            self._check_plain_key(rel, f"payload handle {handle!r}")
        return rel

    def _check_plain_key(self, name: str, what: str) -> None:
        """Refuse a root-relative ``name`` that an object store's client would read as another
        key (or a version of one), or one longer than a store keeps; ``what`` names it."""
        path = posixpath.join(self.path, name)
        problem = _key_problem(self.fs, path)
        if problem is not None:
            raise PayloadHandleError(f"{what} of {self.url} ({path!r}) {problem}")

    def _lexically_relative(self, handle: str) -> str:
        """:meth:`relative` by the path's text alone."""
        if not isinstance(handle, str) or not handle or "\x00" in handle:
            raise PayloadHandleError(f"payload handle must be a non-empty path, found {handle!r}")
        if not handle.isascii():
            # a lone surrogate (JSON carries one): an OS path may hold os.fsdecode's escapes of
            # bytes, a key (UTF-8 on every object store) none
            encoding, errors = (_FS_ENCODING, _FS_ERRORS) if self._os_path else ("utf-8", "strict")
            try:
                handle.encode(encoding, errors)
            except UnicodeEncodeError as exc:
                raise PayloadHandleError(
                    f"payload handle must be a path in {encoding}, found {handle!r} "
                    f"({exc.reason} at {exc.start})"
                ) from None
        path = handle
        if "://" in path:
            protocol = path.split("://", 1)[0]
            protocols = (
                (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
            )
            if protocol not in protocols:
                raise PayloadHandleError(
                    f"payload handle {handle!r} names protocol {protocol!r}; the root {self.url} "
                    f"is on {list(protocols)}"
                )
            path = self.fs._strip_protocol(path)
            if not path.startswith("/"):
                path = "/" + path  # a URL names a whole path: never one relative to the root
        prefix = self._prefix
        if path.startswith("/"):
            path = posixpath.normpath(path)
            if not path.startswith(prefix):
                raise PayloadHandleError(
                    f"payload handle {handle!r} is outside the root {self.url}"
                )
            return path[len(prefix) :]
        rel = posixpath.normpath(path)
        if rel in (".", "..") or rel.startswith("../"):
            raise PayloadHandleError(
                f"payload handle {handle!r} must name a file inside the root {self.url}"
            )
        if not self.fs.root_marker and ("/" + rel).startswith(prefix):
            return ("/" + rel)[len(prefix) :]  # object stores: `bucket/key` is a whole path
        return rel

    def name_of(self, listed: str) -> str:
        """The root-relative name of ``listed``, a path as the filesystem lists it."""
        path = _whole(self.fs._strip_protocol(listed))  # a DirFileSystem lists `v1/x.bin`
        if not path.startswith(self._prefix):
            raise PayloadHandleError(f"listed path {listed!r} is outside the root {self.url}")
        return path[len(self._prefix) :]

    def files(self, entries: Iterable[dict[str, Any]]) -> list[tuple[str, int]]:
        """``(root-relative name, size)`` of the files among fsspec listing ``entries``.

        Directories, directory markers (``key/``: an object store may list an emptied directory
        so for a while, as SeaweedFS does) and the root itself are not files.
        """
        found = []
        root = _whole(self.path)
        for entry in entries:
            listed = entry["name"]
            if entry.get("type") == "directory" or listed.endswith("/"):
                continue
            if _whole(self.fs._strip_protocol(listed)) == root:
                continue
            found.append((self.name_of(listed), int(entry.get("size") or 0)))
        return found

    def full(self, handle: str) -> str:
        """The path of ``handle`` in ``fs``, lexically inside the root.

        On a local-backed root a symlink may still lead out of it: open, create and delete
        through :meth:`open_read`, :meth:`open_directory` and :meth:`remove`, which confine.
        """
        return posixpath.join(self.path, self.relative(handle))

    def open_read(self, handle: str) -> PayloadFile:
        """Open the file ``handle`` names, for reading, confined to the root even while the tree
        changes; a FIFO, device or directory is refused before it is opened.

        Raises :class:`PayloadNotFoundError` (missing), :class:`PayloadPermissionError`,
        :class:`PayloadHandleError` (escape, symlink out of the root, not a regular file) or
        :class:`PayloadReadError` (other I/O).
        """
        return self.open_name(self.relative(handle), handle)

    def open_name(
        self, name: str, handle: str | None = None, root_fd: int | None = None
    ) -> PayloadFile:
        """:meth:`open_read` of ``name``, what :meth:`relative` made of ``handle`` (default:
        ``name`` itself), for a caller that normalised its handles once; only ever a name
        :meth:`relative` returned (on a filesystem that is not local-backed, that is the
        confinement). ``handle`` names the file in messages; ``root_fd``, a descriptor from
        :meth:`held`, is the root to open it beneath (default: a fresh one)."""
        shown = name if handle is None else handle
        # url_of(name), which on a local-backed root is a join that never replaces the root
        url = self.url_of(name) if self._os_dir is None else self._os_dir + name

        def what() -> str:
            return f"payload handle {shown!r} ({url})"

        if self._os_dir is None:
            return _open_fsspec(self.fs, posixpath.join(self.path, name), what(), self.timeout)
        try:
            path_fd = self._open_beneath(name, _PATH, what, root_fd)
            try:
                size = _regular_size(path_fd, what)
                fd = _reopen_to_read(path_fd)
            finally:
                os.close(path_fd)
        except OSError as exc:
            raise _local_error(exc, url, what()) from exc
        return LocalPayloadFile(fd, url, size)

    @contextlib.contextmanager
    def open_directory(self, folder: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the root-relative ``folder`` (local-backed roots), confined to the
        root; with ``create``, the root and ``folder`` (one name) are made when missing, and
        durably so. For writers: create, rename and fsync relative to it."""
        if self._os_path is None:
            raise PayloadHandleError(f"payload root {self.url} is not local-backed")
        if create:
            if "/" in folder:
                raise PayloadHandleError(f"can only create a folder of one name, not {folder!r}")
            os.makedirs(self._os_path, exist_ok=True)
            root_fd = os.open(self._os_path, _DIRECTORY)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, dir_fd=root_fd)
                    os.fsync(root_fd)
            finally:
                os.close(root_fd)
        fd = self._open_beneath(folder, _DIRECTORY, lambda: f"folder {folder!r}")
        try:
            yield fd
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Delete the root-relative file ``name`` (a symlink itself, never its target); raises
        ``FileNotFoundError`` when it is gone or names no file (a folder, a file on its way, a
        name too long: a hostile handle's release), ``OSError`` when it cannot be deleted, and
        :class:`PayloadHandleError` when a folder on its way is a symlink: a deletion follows
        none, not even one that stays inside the root (it would make a second name of a file,
        whose release would delete what a later batch still reads under the first).

        ``name`` is what :meth:`relative` or a listing made of a handle, never normalised again:
        on a bucket root ``b/run`` the name ``b/run/x.bin`` is the file ``b/run/b/run/x.bin``,
        and normalising it would delete the root's own ``x.bin``."""
        rel = self._checked_name(name)
        if self._os_path is None:
            self.call("rm_file", posixpath.join(self.path, rel))
            return
        folder, base = posixpath.split(rel)
        try:
            self._unlink_beneath(rel, folder, base)
        except OSError as exc:  # a folder, a file on the way, a name too long: no such file
            if exc.errno not in (errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG):
                raise
            raise FileNotFoundError(errno.ENOENT, f"no such file ({exc.strerror})", rel) from exc

    def _unlink_beneath(self, rel: str, folder: str, base: str) -> None:
        """:meth:`remove` of a local-backed ``rel``: each folder of ``folder`` opened
        ``O_NOFOLLOW`` from the root's, then ``base`` unlinked there."""
        root_fd = os.open(self._os_path, _ROOT)
        try:
            try:
                fd = _walk_no_symlinks(root_fd, folder, _ROOT) if folder else root_fd
            except OSError as exc:  # ENOTDIR for a link (ELOOP on some kernels), or a file
                link = _symlink_on_way(root_fd, folder)
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP) or link is None:
                    raise
                raise PayloadHandleError(
                    f"payload file {self.url_of(rel)}: {link!r} on its way is a symlink; "
                    "expected folders only (a deletion follows no symlink)"
                ) from None
            try:
                if fd != root_fd and _mount_id(fd) != _mount_id(root_fd):
                    raise _mount_refusal(f"payload file {self.url_of(rel)}", self.url)
                os.unlink(base, dir_fd=fd)
            finally:
                if fd != root_fd:
                    os.close(fd)
        finally:
            os.close(root_fd)

    def _checked_name(self, name: str) -> str:
        """``name`` unchanged, refused unless it is a normalised path inside the root."""
        if (
            not isinstance(name, str)
            or not name
            or "\x00" in name
            or name.startswith(("/", "../"))
            or name == ".."
            or posixpath.normpath(name) != name
        ):
            raise PayloadHandleError(
                f"payload file: expected a normalised name inside the root {self.url}, "
                f"found {name!r}"
            )
        if self._os_path is None:  # a listed key such a client reads as another one
            self._check_plain_key(name, f"payload file {name!r}")
        return name

    @contextlib.contextmanager
    def held(self) -> Iterator[int | None]:
        """One descriptor of the root (None when it is not local-backed) for a caller opening
        many files at once with :meth:`open_name`: each is opened beneath the directory that
        was the root when the descriptor was taken. Hold it for one plan's opens, never across
        calls: a later call must find the root by its path again (a root renamed away and
        replaced is not read), and within one plan a rename racing the opens is no different
        from one just after them, the files being held open for the reads anyway."""
        try:
            root_fd = None if self._os_path is None else os.open(self._os_path, _ROOT)
        except OSError:  # each open then finds the root afresh and says why it cannot
            root_fd = None
        if root_fd is None:
            yield None
            return
        try:
            yield root_fd
        finally:
            os.close(root_fd)

    def _open_beneath(
        self, rel: str, flags: int, what: Callable[[], str], held: int | None = None
    ) -> int:
        """A descriptor of ``rel`` opened with ``flags`` relative to ``held`` or else a fresh
        descriptor of the root, refused unless the kernel's own path of what was opened lies
        inside the root's (``what()`` names it); the caller closes it."""
        root_fd = os.open(self._os_path, _ROOT) if held is None else held
        try:
            if not self.follow_symlinks:
                return self._open_following_none(root_fd, rel, flags, what)
            try:
                fd = _openat2(root_fd, rel, flags)
            except OSError as exc:
                # EXDEV: an absolute symlink, say; EAGAIN: a rename anywhere on the machine
                # raced a ``..`` the kernel resolved. Either way: judged by where it leads.
                if exc.errno not in (errno.EXDEV, errno.EAGAIN):
                    raise
                fd = None
            if fd is None:
                fd = os.open(rel, flags, dir_fd=root_fd)
                try:
                    real, root_real = _fd_path(fd), _fd_path(root_fd)
                    if not _inside(real, root_real):
                        raise PayloadHandleError(
                            f"{what()} resolves through a symlink to {real!r}, outside the root "
                            f"{self.url}"
                        )
                    if not _names_inode_of(fd, root_fd, real[len(root_real) :].lstrip("/")):
                        raise PayloadHandleError(
                            f"{what()} resolves through a symlink to {real!r} as its own mount "
                            f"namespace shows it, which is not what that path names beneath the "
                            f"root {self.url} (another namespace's file, or the tree changed)"
                        )
                    if _mount_id(fd) != _mount_id(root_fd):
                        raise _mount_refusal(what(), self.url)
                except BaseException:
                    os.close(fd)
                    raise
            return fd
        finally:
            if held is None:
                os.close(root_fd)

    def _open_following_none(
        self, root_fd: int, rel: str, flags: int, what: Callable[[], str]
    ) -> int:
        """:meth:`_open_beneath` for a root that follows no symlink beneath it: one on the
        way is refused (:class:`PayloadHandleError`), wherever it leads."""
        try:
            fd = _openat2(root_fd, rel, flags, _RESOLVE_BENEATH_ONLY | _RESOLVE_NO_SYMLINKS)
            if fd is not None:
                return fd
            fd = _walk_no_symlinks(root_fd, rel, flags)
            if _mount_id(fd) != _mount_id(root_fd):
                os.close(fd)
                raise _mount_refusal(what(), self.url)
            return fd
        except OSError as exc:
            if exc.errno == errno.EXDEV:  # no symlink is followed: only a mount point is left
                raise _mount_refusal(what(), self.url) from None
            if (
                exc.errno not in (errno.ELOOP, errno.ENOTDIR)
                or _symlink_on_way(root_fd, rel) is None
            ):
                raise
        raise PayloadHandleError(
            f"{what()} leads through a symlink beneath the root {self.url}; expected folders "
            "and a file only (this root follows no symlink: a retention deletes files by name, "
            "and a claim on a file's second name would not keep it under the first)"
        )
