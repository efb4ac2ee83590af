"""Pytest fixtures of the vLLM suite: the tiny checkpoint, its transformers model, the server.

Import them into a test module (``from vllm_fixtures import vllm_fixture``); the fixtures are
named ``vllm``, ``hf_tiny_moe`` and ``tiny_moe_checkpoint``. The server starts once per
session even when several modules import the fixture, and its log is printed at the end of the
session when a test failed while it ran.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_moe
import vllm_server
from realparts import unavailable
from server_helpers import session_server

CACHE_ENV = "R3DATA_TEST_CACHE"
"""Where built test artefacts are cached (default ``<repo>/.cache``, gitignored)."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, vllm_server.REPO / ".cache"))


@pytest.fixture(scope="session", name="tiny_moe_checkpoint")
def tiny_moe_checkpoint_fixture() -> Path:
    """The tiny Qwen3-MoE checkpoint, built on first use and cached by its recipe."""
    return tiny_moe.cached_checkpoint(cache_root())


@pytest.fixture(scope="session", name="hf_tiny_moe")
def hf_tiny_moe_fixture(tiny_moe_checkpoint: Path) -> Any:
    """The same checkpoint as a transformers model, in the trainer's environment."""
    return tiny_moe.load_model(tiny_moe_checkpoint)


@pytest.fixture(scope="session", name="vllm")
def vllm_fixture(
    tiny_moe_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, request: Any
) -> Iterator[vllm_server.VllmServer]:
    """vLLM's OpenAI server serving the tiny checkpoint with routed experts and sampling masks,
    for the session (what its requests may ask: :mod:`vllm_server`)."""
    reason = vllm_server.missing_environment()
    if reason is not None:
        unavailable(reason)
    yield from session_server(
        request,
        "vLLM server",
        lambda: vllm_server.start(
            tiny_moe_checkpoint, tmp_path_factory.mktemp("vllm") / "server.log"
        ),
        lambda server: server.base_url,
        tail_lines=80,
    )
