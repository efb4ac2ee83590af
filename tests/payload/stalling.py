"""Memory stores that stall: a call waits for ``release`` (or is refused), for the tests of the
per-call timeout (the reader's, the fill's, the CLI's). Tests outside this folder put it on
``sys.path`` first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

from r3data.payload import deadline


def hung_calls() -> int:
    """Calls abandoned at their deadline and still blocked, over every filesystem."""
    with deadline._hung_lock:
        return sum(deadline._hung.values())


def wait_for(condition: Callable[[], bool], seconds: float = 5, poll_s: float = 0.01) -> bool:
    """Whether ``condition()`` holds within ``seconds``, asked every ``poll_s``."""
    until = time.monotonic() + seconds
    while not condition() and time.monotonic() < until:
        time.sleep(poll_s)
    return condition()


class HeldFile:
    """An open file whose reads ask their store first (:meth:`SlowMemory.before_read`, which
    may wait or refuse), then fill the buffer they were given."""

    def __init__(self, f: Any, fs: SlowMemory, path: str) -> None:
        self.f, self.fs, self.path = f, fs, path

    @property
    def closed(self) -> bool:
        return self.f.closed

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def readinto(self, buffer: Any) -> int:
        self.fs.calls.append("read")
        self.fs.reading.set()
        self.fs.before_read(self.path, self.f.tell())
        n = self.f.readinto(buffer)
        self.fs.landed.set()
        return n

    def close(self) -> None:
        self.f.close()


class LateFile:
    """A file that tells whether it was closed (a memory file's close does nothing)."""

    def __init__(self, f: Any) -> None:
        self.f, self.closed = f, False

    def close(self) -> None:
        self.closed = True


class SlowMemory(MemoryFileSystem):
    """A private memory:// store whose reads (``hold="read"``), opens (``"open"``), look-ups
    (``"info"``) or deletions (``"rm"``) wait for ``release``; ``calls`` records every look-up
    and read."""

    cachable = False

    def __init__(self) -> None:
        super().__init__(global_store=False)
        self.hold = ""
        self.release, self.reading, self.landed = (threading.Event() for _ in range(3))
        self.late: list[Any] = []  # files opened after their caller gave up
        self.calls: list[str] = []

    def before_read(self, path: str, offset: int) -> None:
        """What a read of ``path`` at ``offset`` waits for first."""
        if self.hold == "read":
            self.release.wait()

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("info")
        if self.hold == "info":
            self.release.wait()
        return super().info(path, **kwargs)

    def rm_file(self, path: str) -> None:
        if self.hold == "rm":
            self.release.wait()
        super().rm_file(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "r" not in mode:
            return f
        if self.hold == "open":
            self.release.wait()
            f = LateFile(f)
            self.late.append(f)
            return f
        return HeldFile(f, self, self._strip_protocol(path))
