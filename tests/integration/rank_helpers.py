"""Ranks of a real ``torch.distributed`` group, each a spawned process, for the multi-process
tests (megatron replay grids, the data-parallel trainer loop).

A rank's work runs in its own interpreter; its result or its traceback comes back through a
queue, and the parent fails the test (never hangs) when a rank fails or is not done in time.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest


def _report(work: Callable[..., Any], rank: int, args: tuple, results: Any) -> None:
    try:
        results.put((rank, "ok", work(rank, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def spawn_ranks(
    work: Callable[..., Any], world: int, args: tuple, deadline_s: float
) -> dict[int, Any]:
    """``work(rank, *args)`` on ``world`` spawned processes (``work`` a module-level function,
    ``args`` picklable): each rank's result by rank. Fails the test with every failing rank's
    traceback, or naming the ranks not done within ``deadline_s``."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=_report, args=(work, rank, args, results), daemon=True)
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    reports, errors = {}, {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(reports) + len(errors) < world:
            try:
                rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(
                    f"ranks {sorted(set(range(world)) - set(reports))} hung past {deadline_s} s"
                )
            (reports if status == "ok" else errors)[rank] = payload
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        pytest.fail("\n".join(f"rank {rank}:\n{trace}" for rank, trace in sorted(errors.items())))
    return reports
