"""A :class:`~r3data.payload.reader.Plan` run inline (one worker, one job, or from a pool
thread: the small local fill, the common case) interrupted anywhere in its own bookkeeping by
the caller's ``KeyboardInterrupt`` (a signal lands between any two lines): the interrupt comes
back promptly, it never waits forever for a job of its own thread."""

from __future__ import annotations

from pathlib import Path

import pytest
from traced import run_traced

from r3data.payload import reader as reader_module
from r3data.payload.reader import Plan

READER = str(Path(reader_module.__file__).resolve())


def run_interrupted_at(line_event: int, workers: int, n: int) -> tuple[bool, BaseException | None]:
    """Run a plan of ``n`` jobs on ``workers`` in a thread of its own, raising
    ``KeyboardInterrupt`` at the ``line_event``-th line the plan's own code runs in that thread
    (as a signal would); returns (whether it ended in time, what it raised)."""
    seen = [0]

    def trace(frame, event, arg):
        if frame.f_code.co_filename != READER:
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == line_event:
                raise KeyboardInterrupt
        return trace

    return run_traced(trace, lambda: Plan().run(lambda i: None, n, workers))


@pytest.mark.parametrize(("workers", "n"), [(1, 3), (4, 1)], ids=["one_worker", "one_job"])
def test_an_interrupt_anywhere_in_an_inline_plan_comes_back(workers, n):
    for line_event in range(1, 80):
        ended, raised = run_interrupted_at(line_event, workers, n)
        assert ended, f"interrupted at line event {line_event}: the plan never returned"
        if raised is None:  # past the plan's last line: it had finished
            break
        assert isinstance(raised, KeyboardInterrupt), (line_event, raised)
    else:
        pytest.fail("the plan never finished uninterrupted within the lines tried")
