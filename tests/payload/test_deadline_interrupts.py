"""A call with a deadline (:func:`r3data.payload.deadline.within`) whose caller is interrupted
(a ``KeyboardInterrupt`` lands between any two lines of the caller's side, as a signal would):
what the call returns is either returned or handed to ``late`` to be released, never dropped
open; a call whose caller left before it started never starts; and no thread is left waiting
for a task that never comes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import stalling
from traced import run_traced

from r3data.payload import deadline

DEADLINE = str(Path(deadline.__file__).resolve())


class Handle:
    """A result that holds something (a file, a connection) until closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def interrupted_at(line_event: int, call: Any, late: Any, finished: Any) -> tuple[bool, Any, bool]:
    """``within(call)`` on a thread of its own, ``KeyboardInterrupt`` raised at the
    ``line_event``-th line of deadline.py that thread runs; returns (ended in time, what it
    returned or raised, whether ``finished()`` held when the interrupt was raised)."""
    seen = [0]
    late_interrupt = [False]
    last: dict[int, int] = {}

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != DEADLINE:
            return None
        if event == "line":
            # a line event back at a ``with`` line is its exit, where an exception cannot
            # reach ``__exit__`` (a CPython limit for any lock, bpo-29988): not a place tried
            forward = frame.f_lineno > last.get(id(frame), 0)
            last[id(frame)] = frame.f_lineno
            if forward:
                seen[0] += 1
                if seen[0] == line_event:
                    late_interrupt[0] = finished()
                    raise KeyboardInterrupt
        return trace

    ended, result = run_traced(
        trace, lambda: deadline.within(5.0, "a test call", call, "interrupts", late)
    )
    return ended, result, late_interrupt[0]


def wait_for(condition: Callable[[], bool], seconds: float = 5) -> bool:
    """:func:`stalling.wait_for`, asked every 2 ms: the campaigns below wait once per line."""
    return stalling.wait_for(condition, seconds, poll_s=0.002)


def hung_calls() -> int:
    with deadline._hung_lock:
        return deadline._hung.get(id("interrupts"), 0)


def test_an_interrupt_anywhere_in_the_callers_side_drops_no_result_open():
    for line_event in range(1, 200):
        made: list[Handle] = []

        def call(made: list[Handle] = made) -> Handle:
            time.sleep(0.005)  # the caller usually reaches its wait (or is interrupted) first
            made.append(Handle())
            return made[-1]

        ended, result, returning = interrupted_at(
            line_event, call, Handle.close, lambda made=made: bool(made)
        )
        assert ended, f"interrupted at line event {line_event}: the call never returned"
        if not isinstance(result, BaseException):  # past the caller's last line: returned
            assert wait_for(lambda made=made: bool(made))
            assert result is made[0]
            assert not result.closed
            break
        assert isinstance(result, KeyboardInterrupt), (line_event, result)
        if returning:  # the result was the caller's already: lost as any function's return is
            continue
        # the call ran and its result was released, or it never started (its caller had left)
        wait_for(lambda made=made: bool(made) and made[0].closed, 0.2)
        assert all(handle.closed for handle in made), f"line event {line_event}: left open"
        assert wait_for(lambda: hung_calls() == 0), f"line event {line_event}: counted as hung"
    else:
        pytest.fail("the call never returned uninterrupted within the lines tried")


class HeldThreads(deadline._Threads):
    """Threads that take their tasks only once ``go`` is set (a machine too busy to schedule
    the thread before its caller's deadline)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def _serve(self) -> None:
        self.go.wait(5)
        super()._serve()


def test_a_call_whose_caller_left_before_it_started_never_starts(monkeypatch):
    threads = HeldThreads()
    monkeypatch.setattr(deadline, "_threads", threads)
    calls: list[int] = []
    with pytest.raises(deadline.PayloadReadError, match=r"no answer within the timeout of 0\.05 s"):
        deadline.within(0.05, "a test call", lambda: calls.append(1), "interrupts")
    assert hung_calls() == 0  # not blocked in the filesystem: never counted as hung
    threads.go.set()
    assert wait_for(lambda: threads._waiting == 1)  # the thread took the task, and skipped it
    assert calls == []
    assert deadline.within(1.0, "a test call", lambda: 7, "interrupts") == 7


def test_threads_serve_every_queued_task_and_none_waits_for_nothing():
    threads = deadline._Threads()
    gate = threading.Event()
    done: list[int] = []
    for i in range(6):  # six blocked at once: six threads, no task behind another
        threads.start(lambda i=i: (gate.wait(5), done.append(i)))
    assert wait_for(lambda: threads._waiting == 0 and not threads._tasks)
    gate.set()
    assert wait_for(lambda: sorted(done) == list(range(6)))
    assert wait_for(lambda: threads._waiting == 6)  # all six idle again, all reusable
    before = {t.ident for t in threading.enumerate() if t.name == "r3data-deadline"}
    served: list[int] = []
    for _ in range(20):
        finished = threading.Event()
        threads.start(
            lambda finished=finished: (served.append(threading.get_ident()), finished.set())
        )
        assert finished.wait(5)
    assert set(served) <= before  # reused, none started
