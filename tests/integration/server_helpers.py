"""A real server as a child process, for the integration suite (vLLM, SeaweedFS): its venv's
install check, its launch with the output in a log file, the wait until it answers, its stop
by PID and process group, and its session fixture.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from realparts import say


class ServerError(AssertionError):
    """A server did not start, died, or answered a request with an error."""


def not_installed(what: str, venv: Path, target: str) -> str:
    """Why the ``what`` venv cannot run here (one line): not installed by ``make <target>``,
    with the last line of its install log when there is one."""
    log = Path(f"{venv}-install.log")
    last = ""
    if log.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        last = f": {lines[-1].strip()[:200]}" if lines else ""
    return f"the {what} environment {venv} is not installed (make {target}){last}"


@dataclass
class ServerProcess:
    """One server process: started in its own session (so that a stuck stop can end its whole
    process group), its output appended to ``log_path``, run from the log's folder."""

    name: str
    """The server in messages ("vLLM server", "SeaweedFS")."""
    log_path: Path
    stop_timeout_s: float
    process: subprocess.Popen[bytes] | None = None

    def launch(
        self,
        command: list[str],
        answers: Callable[[], bool],
        *,
        ready_timeout_s: float,
        poll_s: float,
        env: dict[str, str] | None = None,
    ) -> float:
        """Start ``command``; the seconds until ``answers()`` held. :class:`ServerError` when
        the process exits first, or (once stopped) when it does not answer in time."""
        launched = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_path.parent,
                start_new_session=True,
            )
        deadline = launched + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with {self.process.returncode}\n{self.tail()}"
                )
            if answers():
                return time.monotonic() - launched
            time.sleep(poll_s)
        self.stop()
        raise ServerError(f"{self.name} not ready after {ready_timeout_s:.0f} s\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL, as a crash: no clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(self.stop_timeout_s)

    def stop(self) -> int | None:
        """SIGTERM to its PID (a server stops its own workers), then SIGKILL to whatever of its
        process group is left after a grace period; its exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(self.stop_timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(self.stop_timeout_s)

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` of its log, under a header naming it."""
        try:
            text = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            text = f"(no {self.name} log at {self.log_path}: {err})"
        return f"--- last lines of the {self.name} log {self.log_path} ---\n{text}"


class Server(Protocol):
    started_s: float
    log_path: Path

    def stop(self) -> int | None: ...
    def tail(self, lines: int = 40) -> str: ...


S = TypeVar("S", bound=Server)
_running: dict[str, Any] = {}


def session_server(
    request: Any, name: str, start: Callable[[], S], address: Callable[[S], str], tail_lines: int
) -> Iterator[S]:
    """The body of a session fixture yielding a server: started once even when several modules
    import the fixture (each import is a fixture of its own), stopped at the end of the
    session, its log's tail printed when a test failed while it ran."""
    server = _running.get(name)
    if server is not None:
        yield server
        return
    server = start()
    _running[name] = server
    failed_before = request.session.testsfailed
    say(request.config, f"\n{name} ready in {server.started_s:.1f} s at {address(server)}")
    yield server
    status = server.stop()
    del _running[name]
    if request.session.testsfailed > failed_before:
        say(request.config, server.tail(tail_lines))
    say(request.config, f"{name} stopped (exit {status}); log kept at {server.log_path}")
