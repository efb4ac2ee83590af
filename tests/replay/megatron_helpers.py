"""Shared pieces for the megatron replay tests: configs, real routers, routes, free ports."""

from __future__ import annotations

import socket
import warnings

import torch

EXPERTS, TOPK, HIDDEN = 8, 2, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_import_megatron() -> None:
    """Import megatron-core once with its 'no Transformer Engine / Apex' warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state
        import megatron.core.transformer.moe.router  # noqa: F401


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
