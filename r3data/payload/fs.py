"""A payload root on any fsspec filesystem, and the rule that no handle resolves outside it.

Handles come from inference servers over the network, so each one is resolved lexically (no
``..`` above the root, no absolute path or URL elsewhere) and, on a local filesystem, again
after following symlinks (directories are resolved once per root object and remembered; a
file that is itself a symlink is resolved on every use).
"""

from __future__ import annotations

import os
import posixpath

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from r3data.errors import PayloadHandleError, PayloadNotFoundError

__all__ = ["PayloadRoot"]

_MAX_REMEMBERED_DIRS = 4096


class PayloadRoot:
    """Where payload files live: ``fs`` and the ``path`` of the root inside it.

    ``root`` is a local path or any fsspec URL (``memory://r3``, ``s3://bucket/run``); pass
    ``fs`` to use an already configured filesystem, ``root`` then being a path inside it.
    """

    def __init__(self, root: str | os.PathLike[str], fs: AbstractFileSystem | None = None) -> None:
        if fs is None:
            fs, path = fsspec.core.url_to_fs(os.fspath(root))
        else:
            path = fs._strip_protocol(os.fspath(root))
        self.fs: AbstractFileSystem = fs
        self.local = type(fs) is LocalFileSystem
        if self.local:
            path = os.path.abspath(path)
            self._real = os.path.realpath(path)
            self._real_dirs: dict[str, str] = {}
        self.path: str = path.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"PayloadRoot({self.url!r})"

    @property
    def url(self) -> str:
        """The root as a user would write it: a local path, or a URL on any other filesystem."""
        return self.path if self.local else self.fs.unstrip_protocol(self.path)

    def require(self) -> None:
        """Raise :class:`PayloadNotFoundError` when the root does not exist."""
        if not self.fs.exists(self.path):
            raise PayloadNotFoundError(f"payload root {self.url} does not exist")

    def relative(self, handle: str) -> str:
        """``handle`` as a normalised path relative to the root; refuses one that escapes it."""
        if not isinstance(handle, str) or not handle or "\x00" in handle:
            raise PayloadHandleError(f"payload handle must be a non-empty path, found {handle!r}")
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
        if path.startswith("/"):
            path = posixpath.normpath(path)
            prefix = self.path.rstrip("/") + "/"
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
        return rel

    def name_of(self, listed: str) -> str:
        """The root-relative name of ``listed``, a path as the filesystem lists it."""
        path = self.fs._strip_protocol(listed).rstrip("/")
        prefix = self.path.rstrip("/") + "/"
        if not path.startswith(prefix):
            raise PayloadHandleError(f"listed path {listed!r} is outside the root {self.url}")
        return path[len(prefix) :]

    def full(self, handle: str) -> str:
        """The path of ``handle`` on the filesystem, checked to stay inside the root."""
        path = posixpath.join(self.path, self.relative(handle))
        if self.local:
            folder, name = posixpath.split(path)
            real = posixpath.join(self._real_dir(folder), name)
            if os.path.islink(real):
                real = os.path.realpath(real)
            if not self._inside(real):
                raise PayloadHandleError(
                    f"payload handle {handle!r} resolves through a symlink to {real!r}, outside "
                    f"the root {self.url}"
                )
        return path

    def _inside(self, real: str) -> bool:
        return real == self._real or real.startswith(self._real.rstrip(os.sep) + os.sep)

    def _real_dir(self, folder: str) -> str:
        """``realpath(folder)``, remembered: a version directory holds many files."""
        real = self._real_dirs.get(folder)
        if real is None:
            if len(self._real_dirs) >= _MAX_REMEMBERED_DIRS:
                self._real_dirs.clear()
            real = self._real_dirs[folder] = os.path.realpath(folder)
        return real
