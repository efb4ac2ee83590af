"""Run a call on a thread of its own under a trace function (``sys.settrace``), for the tests
that raise ``KeyboardInterrupt`` at a chosen line as a signal would."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any


def run_traced(trace: Callable[..., Any], work: Callable[[], Any]) -> tuple[bool, Any]:
    """``work()`` on a daemon thread traced by ``trace``; returns (whether it ended within 5 s,
    what it returned or raised)."""
    outcome: list[Any] = [None]

    def caller() -> None:
        sys.settrace(trace)
        try:
            outcome[0] = work()
        except BaseException as exc:
            outcome[0] = exc
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    thread.join(5)
    return not thread.is_alive(), outcome[0]
