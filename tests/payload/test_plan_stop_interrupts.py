"""A batch prepared within a :class:`~r3data.payload.reader.PlanStop` whose thread is
interrupted (a ``KeyboardInterrupt`` lands between any two lines of reader.py, as a signal
would): the stop never stays on the thread after the call, so that a later plan of the
trainer's own on that thread does not answer to a loader's stop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traced import run_traced

from r3data.payload import reader

READER = str(Path(reader.__file__).resolve())


def stop_left_after_interrupt_at(line_event: int) -> tuple[bool, Any, Any]:
    """``PlanStop().run(call)`` on a thread of its own, ``KeyboardInterrupt`` raised at the
    ``line_event``-th line of reader.py it runs; returns (whether it was raised, what the run
    returned or raised, the thread's stop after the run)."""
    seen = [0]
    raised = [False]
    stop = reader.PlanStop()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != READER:
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == line_event:
                raised[0] = True
                raise KeyboardInterrupt
        return trace

    def work() -> Any:
        try:
            return stop.run(lambda: reader._PLAN_STOP.get() is stop)
        except KeyboardInterrupt as exc:
            return exc
        finally:
            left[0] = reader._PLAN_STOP.get()

    left: list[Any] = [None]
    ended, result = run_traced(trace, work)
    assert ended
    return raised[0], result, left[0]


def test_a_plan_stop_holds_inside_its_run_and_an_interrupt_anywhere_never_leaves_it_set():
    raised, result, left = stop_left_after_interrupt_at(0)  # no interrupt
    assert (raised, result, left) == (False, True, None)
    line = 1
    while True:
        raised, result, left = stop_left_after_interrupt_at(line)
        if not raised:
            break  # every line of the run was tried
        assert left is None, f"interrupted at line event {line}: the stop stayed on the thread"
        assert isinstance(result, KeyboardInterrupt | bool), result
        line += 1
    assert line > 1
