"""``time_interleaved``: every case runs ``repeats`` times, interleaved, each run after a
collection that frees what the runs before it left; a smoke run's ``freeze_heap`` leaves the
heap that lived before the first run out of those collections, and gives it back after."""

from __future__ import annotations

import gc
import weakref

import pytest

from r3data.benchmarking import time_interleaved


class Cycle:
    """An object that only a collection frees (it references itself)."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("freeze_heap", [False, True])
def test_runs_interleave_and_each_starts_with_the_last_runs_garbage_freed(freeze_heap):
    order: list[str] = []
    left: list[weakref.ref] = []
    frozen: list[int] = []

    def case(name: str) -> None:
        assert all(ref() is None for ref in left), "a run's garbage lived into the next run"
        order.append(name)
        frozen.append(gc.get_freeze_count())
        left.append(weakref.ref(Cycle()))

    before = gc.get_freeze_count()
    seconds = time_interleaved(
        {"a": lambda: case("a"), "b": lambda: case("b")}, 3, freeze_heap=freeze_heap
    )
    assert order == ["a", "b"] * 3
    assert {name: len(runs) for name, runs in seconds.items()} == {"a": 3, "b": 3}
    assert all(run >= 0 for runs in seconds.values() for run in runs)
    assert all((count > before) == freeze_heap for count in frozen), frozen
    assert gc.get_freeze_count() == before  # the heap is given back


def test_a_failing_case_gives_the_frozen_heap_back():
    before = gc.get_freeze_count()

    def failing() -> None:
        raise RuntimeError("case failed")

    with pytest.raises(RuntimeError, match="case failed"):
        time_interleaved({"failing": failing}, 2, freeze_heap=True)
    assert gc.get_freeze_count() == before


def test_a_heap_the_caller_froze_stays_frozen():
    gc.collect()
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        assert before > 0
        time_interleaved({"a": lambda: Cycle()}, 2, freeze_heap=True)
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
