"""What the integration suite shares: the skip-or-fail rule for real parts, and a line on the
terminal past pytest's capture.

A real part that cannot be brought up here is a skip with a one-line reason, except under
``R3DATA_REQUIRE_INTEGRATION=1`` (CI sets it), where it is a failure: a skipped real-server
suite must not pass CI.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "R3DATA_REQUIRE_INTEGRATION"


def unavailable(reason: str) -> None:
    """Skip (or, when the suite is required, fail) because a real part cannot run: ``reason``."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def say(config: pytest.Config, text: str) -> None:
    """A line on the terminal, past pytest's output capture (a server's log, a figure)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(text)
