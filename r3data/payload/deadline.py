"""Calls to a filesystem that is not local-backed, each given up after a timeout.

A store that accepts connections but stops answering, or trickles, must fail a call in bounded
time, typed, instead of blocking its caller for as long as the client library's own timeouts
and retries add up to. On an event-loop filesystem (s3fs, gcsfs, adlfs) the call's coroutine
is cancelled at the deadline; on any other the call runs on a daemon thread that is waited on,
and abandoned at the deadline with what it holds.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.dirfs import DirFileSystem

from r3data.errors import ConfigError, PayloadReadError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KEEP_IDLE_THREADS",
    "MAX_HUNG_CALLS",
    "bounded",
    "checked_timeout",
    "on_event_loop",
    "timed_out",
    "within",
]

DEFAULT_TIMEOUT_S = 30.0
"""Seconds one call to a filesystem that is not local-backed may take (a look-up, a ranged read
of at most one chunk, a listing, a deletion) before it counts as failed, with whatever retries
the client library makes inside it: a store that accepts connections but stops answering, or
trickles, fails the call in bounded time instead of blocking its caller for as long as the
client's own timeouts and retries add up to (minutes with botocore's and s3fs's)."""


def checked_timeout(timeout: float | None) -> float | None:
    """``timeout`` (seconds, > 0 and at most ``threading.TIMEOUT_MAX``, or None for no limit),
    else :class:`ConfigError`."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ConfigError(f"timeout must be seconds (a number > 0) or None, found {timeout!r}")
    if not (math.isfinite(timeout) and 0 < timeout <= threading.TIMEOUT_MAX):
        raise ConfigError(
            f"timeout must be a finite number of seconds > 0 and at most "
            f"{threading.TIMEOUT_MAX:g} (what a thread can wait), found {timeout!r}"
        )
    return float(timeout)


def timed_out(doing: str, timeout: float) -> PayloadReadError:
    return PayloadReadError(f"{doing}: no answer within the timeout of {timeout:g} s")


def on_event_loop(fs: AbstractFileSystem, method: str) -> Callable[..., Any] | None:
    """The coroutine function behind ``fs.<method>`` when ``fs`` runs it on an event loop
    (s3fs, gcsfs, adlfs, a ``DirFileSystem`` over one), else None."""
    inner = fs
    while isinstance(inner, DirFileSystem):  # async by its class, whatever it reads through
        inner = inner.fs
    if not (isinstance(inner, AsyncFileSystem) and inner.async_impl):
        return None
    return getattr(fs, f"_{method}", None)


def bounded(
    fs: AbstractFileSystem, timeout: float | None, doing: str, method: str, *args: Any, **kw: Any
) -> Any:
    """``fs.<method>(*args, **kw)`` given up after ``timeout`` seconds (None: no limit), as
    :class:`PayloadReadError` naming ``doing``. On an event-loop filesystem the coroutine is
    cancelled at the deadline (fsspec's ``sync(..., timeout=...)``): its connection is closed,
    nothing is left running; on any other, see :func:`within`."""
    coroutine = None if timeout is None else on_event_loop(fs, method)
    if coroutine is None:
        return within(timeout, doing, partial(getattr(fs, method), *args, **kw), fs)
    try:
        return sync(fs.loop, coroutine, *args, timeout=timeout, **kw)
    except FSTimeoutError:
        raise timed_out(doing, timeout) from None


MAX_HUNG_CALLS = 64
"""Calls abandoned at their deadline (each a daemon thread still blocked in the filesystem) one
filesystem may have at once: past it a call is refused at once instead of leaving one more
thread behind, so a store that stays stalled while every batch tries again cannot pile up
threads without bound."""

KEEP_IDLE_THREADS = 32
"""Threads that ran a call with a deadline kept waiting for the next one (past it, a thread
ends after its call): as many as the widest I/O pool (:data:`r3data.parallel.IO_WORKERS_MAX`)
keeps calling at once."""


class _Threads:
    """The daemon threads calls with a deadline run on: a thread idle since its last call is
    reused (starting one costs as much as a fast call), one is started when none is idle, so a
    call never waits behind another and a hung call keeps its own thread. Daemons: a hung call
    never holds up the interpreter's exit. The tasks wait in one queue that every idle thread
    takes from, so a caller interrupted while handing one over strands no thread."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._waiting = 0  # threads waiting for a task (counted by the threads themselves)

    def start(self, task: Callable[[], None]) -> None:
        """Run ``task`` (which raises nothing) on an idle thread, else on a new one."""
        with self._ready:
            self._tasks.append(task)
            more = len(self._tasks) > self._waiting
            self._ready.notify()
        if more:
            threading.Thread(target=self._serve, name="r3data-deadline", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._ready:
                if self._waiting >= KEEP_IDLE_THREADS and not self._tasks:
                    return
                self._waiting += 1
                while not self._tasks:
                    self._ready.wait()
                self._waiting -= 1
                task = self._tasks.popleft()
            task()


_threads: _Threads | None = None  # created on first use; a forked child starts without one
_hung: dict[int, int] = {}  # id(filesystem) -> its calls abandoned and still blocked (each
# thread holds its filesystem, so an id counted here is never another's)
_hung_lock = threading.Lock()


def _after_fork() -> None:
    """In a forked child: none of the parent's threads exist, idle or hung, and a lock one of
    them held stays held."""
    global _threads, _hung, _hung_lock
    _threads, _hung, _hung_lock = None, {}, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def within(
    timeout: float | None,
    doing: str,
    call: Callable[[], Any],
    fs: object,
    late: Callable[[Any], None] | None = None,
) -> Any:
    """``call()`` on a daemon thread (:class:`_Threads`), waited for at most ``timeout``
    seconds (None: called here). A call past its deadline, or whose caller is interrupted
    while it waits, is abandoned to its thread (a blocking call cannot be interrupted): it must
    touch nothing its caller still uses (its exception is dropped; a result is handed to
    ``late``, to release what it holds; a call abandoned before it started never starts), and as a
    daemon it never holds up the interpreter's exit. While :data:`MAX_HUNG_CALLS` of ``fs``'s
    calls are abandoned and still blocked, another is refused at once."""
    global _threads
    if timeout is None:
        return call()
    outcome: list[Any] = []
    done = threading.Lock()  # released once the call returned or raised (cheaper than an Event)
    done.acquire()
    state = {"running": False, "finished": False, "abandoned": False}  # under _hung_lock
    key = id(fs)

    def run() -> None:
        with _hung_lock:
            if state["abandoned"]:  # its caller left before it started: never started
                return
            state["running"] = True
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the waiting caller
            outcome.append((False, exc))
        finally:
            with _hung_lock:
                state["finished"] = True
                abandoned = state["abandoned"]
                if abandoned:
                    _hung[key] -= 1
                    if not _hung[key]:
                        del _hung[key]
            done.release()
            if abandoned and late is not None and outcome[0][0]:
                with contextlib.suppress(Exception):
                    late(outcome[0][1])

    with _hung_lock:
        hung = _hung.get(key, 0)
        threads = _threads = _threads or _Threads()
    if hung >= MAX_HUNG_CALLS:
        raise PayloadReadError(
            f"{doing}: refused, {hung} earlier calls to this filesystem are still unanswered "
            f"past their timeout of {timeout:g} s"
        )
    try:
        threads.start(run)
        done.acquire(timeout=timeout)
    finally:  # past the deadline, or the caller interrupted: the call is left to its thread
        with _hung_lock:
            if not state["finished"]:
                state["abandoned"] = True
                if state["running"]:  # blocked in the filesystem (else it never starts)
                    _hung[key] = _hung.get(key, 0) + 1
    if state["abandoned"]:
        raise timed_out(doing, timeout)
    ok, value = outcome[0]
    if ok:
        return value
    raise value
