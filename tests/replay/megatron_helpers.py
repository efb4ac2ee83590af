"""Shared pieces for the megatron replay tests: configs, real routers, routes, a rank's run
over parallel grids."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch

EXPERTS, TOPK, HIDDEN = 8, 2, 16
#: A grid's sizes (its keys ``tp``, ``pp``, ``cp``, ``ep``) as ``initialize_model_parallel``
#: takes them.
PARALLEL_SIZES = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
}


def quiet_import_megatron() -> None:
    """Import megatron-core once with its 'no Transformer Engine / Apex' warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state
        import megatron.core.transformer.moe.router  # noqa: F401


def on_each_grid(
    rank: int, world: int, port: int, grids: Mapping[str, dict], measure: Callable[[dict], dict]
) -> dict[str, dict]:
    """One rank of a gloo group (rendezvous on ``port``): ``measure(grid)`` for each grid in
    turn, by name, with megatron's ``parallel_state`` set to the grid's sizes and router
    replay state cleared before and after."""
    quiet_import_megatron()
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    report = {}
    try:
        for name, grid in grids.items():
            sizes = {
                PARALLEL_SIZES[key]: size for key, size in grid.items() if key in PARALLEL_SIZES
            }
            parallel_state.initialize_model_parallel(**sizes, create_gloo_process_groups=False)
            RouterReplay.clear_global_router_replay_instances()
            try:
                report[name] = measure(grid)
            finally:
                RouterReplay.clear_global_router_replay_instances()
                parallel_state.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
    return report


def make_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = {
        "num_layers": 3,
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_enable_routing_replay": True,
        "moe_ffn_hidden_size": HIDDEN,
        "use_cpu_initialization": True,
        "add_bias_linear": False,
    }
    options.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**options)


def build_routers(config, layer_numbers) -> list:
    """Real ``TopKRouter``s for the given (1-based) layer numbers, in construction order."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    groups = ProcessGroupCollection.use_mpu_process_groups()
    routers = []
    for number in layer_numbers:
        router = TopKRouter(config, groups)
        router.set_layer_number(number)
        routers.append(router)
    return routers


def distinct_routes(tokens: int, topk: int, experts: int, generator) -> torch.Tensor:
    """``[tokens, topk]`` int64 rows of distinct expert ids."""
    return torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :topk]


def routing_map(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """The boolean ``[tokens, experts]`` map megatron builds from top-k indices."""
    mask = torch.zeros(indices.shape[0], experts, dtype=torch.bool)
    return mask.scatter(1, indices.long(), True)
