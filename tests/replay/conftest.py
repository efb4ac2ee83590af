"""Fixtures of the megatron replay tests (a module asks for ``world_of_one`` to run in a
one-process megatron world); megatron is imported only by the fixtures that need it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from megatron_helpers import build_routers, make_config


@pytest.fixture(scope="module")
def world_of_one():
    """A one-process gloo world with megatron's parallel state, for the module that asks."""
    from megatron.core import parallel_state

    sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
    from realparts import free_port

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture
def config():
    return make_config()


@pytest.fixture
def routers(config):
    """Real routers of layers 1-3, megatron's global replay state cleared around them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    built = build_routers(config, [1, 2, 3])
    yield built
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_router_replay_instances()
