"""``ThreadStops``: the stop of the batch each of a loader's threads prepares.

A loader's batch runs within its thread's :class:`~r3data.payload.reader.PlanStop`; a reset,
the loader collected, or the interpreter exiting sets it, so that the batch's reads stop at
their next call to the filesystem and no pool lane keeps retrying for a batch nobody will take.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref

from r3data.payload.reader import PlanStop

__all__ = ["ThreadStops"]


class ThreadStops:
    """The stop of the batch each thread prepares: one :class:`PlanStop` per thread, set when
    the node running that thread shuts it down (:meth:`retire`), resets in place
    (:meth:`clear`), or is collected or the interpreter exits (:meth:`close`)."""

    def __init__(self) -> None:
        # reentrant: a collection inside it may run a dropped node's finalizer (close)
        self._lock = threading.RLock()
        self._threads: weakref.WeakKeyDictionary[threading.Thread, PlanStop] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        _LIVE.add(self)

    def of_caller(self) -> PlanStop:
        """The stop of the calling thread (a new one for a thread first seen)."""
        thread = threading.current_thread()
        with self._lock:
            stop = self._threads.get(thread)
            if stop is None:
                stop = self._threads[thread] = PlanStop()
                if self._closed:
                    stop.set()
        return stop

    def retire(self, thread: threading.Thread | None) -> None:
        """Stop every thread seen so far and ``thread`` for good: a shut-down run's threads
        prepare no other batch (a thread first seen later has a stop of its own)."""
        with self._lock:
            if thread is not None:
                self._threads.setdefault(thread, PlanStop())
            stops = list(self._threads.values())
        for stop in stops:
            stop.set()

    def clear(self) -> None:
        """Stop every thread's batch and forget their stops: the next run starts afresh."""
        with self._lock:
            stops = list(self._threads.values())
            self._threads.clear()
        for stop in stops:
            stop.set()

    def close(self) -> None:
        """Stop every batch, now and later."""
        with self._lock:
            self._closed = True
        self.retire(None)


_LIVE: weakref.WeakSet[ThreadStops] = weakref.WeakSet()


def _close_all() -> None:
    for stops in list(_LIVE):
        stops.close()


def _forget_threads_in_child() -> None:
    """A forked child has none of the parent's threads, nor their batches; a lock one of them
    held at the fork stays held (the child's exit closes every loader's stops)."""
    for stops in list(_LIVE):
        stops._lock = threading.RLock()
        stops._threads = weakref.WeakKeyDictionary()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_threads_in_child)


# Before the interpreter joins the shared pool's lanes (concurrent.futures registered its join
# when r3data.parallel was imported; these hooks run last registered first), so that no lane
# keeps retrying a read for a batch nobody will take; ``atexit`` would run after that join.
(getattr(threading, "_register_atexit", None) or atexit.register)(_close_all)
