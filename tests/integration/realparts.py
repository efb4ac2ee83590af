"""What the tests of real parts share: the skip-or-fail rule, a line on the terminal past
pytest's capture, and free loopback ports (a server's, a process group's rendezvous).

A real part that cannot be brought up here is a skip with a one-line reason, except under
``R3DATA_REQUIRE_INTEGRATION=1`` (CI sets it), where it is a failure: a skipped real-server
suite must not pass CI.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

REQUIRE_ENV = "R3DATA_REQUIRE_INTEGRATION"


def unavailable(reason: str) -> None:
    """Skip (or, when the suite is required, fail) because a real part cannot run: ``reason``."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def say(config: pytest.Config, text: str) -> None:
    """A line on the terminal, past pytest's output capture (a server's log, a figure). In an
    xdist worker it goes to the worker's standard error, which is the run's terminal."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        if hasattr(config, "workerinput"):
            print(text, file=sys.stderr, flush=True)
        else:
            reporter.write_line(text)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (the kernel's choice)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            ports.append(int(sock.getsockname()[1]))
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port() -> int:
    """One free loopback port."""
    (port,) = free_ports(1)
    return port
