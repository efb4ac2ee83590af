"""Replay through megatron-core's full ``MoELayer`` (router, allgather token dispatcher,
``SequentialMLP`` experts) on two gloo ranks, forward and backward with activation
recompute, for EP 2 and for TP 2 with sequence parallelism.

Routes travel as a prime-rl envelope through ``r3data.loader``, are laid out for the rank by
``megatron_layout`` + ``expand`` and installed by ``replay_step``. Each rank checks that its
router's routing map, in the forward and again in the recompute, names exactly its tokens'
routes; that the dispatcher's map gathered over TP x EP names every rank's tokens' routes;
that the backward FIFO holds one entry after the forward and none after the backward; and
that the recomputed layer gives the gradients of the same layer without recompute.

On a CPU build megatron-core 0.16.1 needs three shims, set in the spawned ranks only:
``TopKRouter.gating`` moves its weight to CUDA (replaced by a plain linear),
``tensor_parallel.checkpoint`` saves and restores the CUDA RNG state (made no-ops; the CPU
RNG state is still saved), and ``tensor_parallel.mappings`` allocates the gather and
reduce-scatter buffers on ``torch.cuda.current_device()`` (pointed at the CPU).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import on_each_grid, quiet_import_megatron

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from rank_helpers import spawn_ranks
from realparts import free_port

WORLD, HIDDEN, EXPERTS, TOPK = 2, 16, 4, 2
LENGTHS = (7, 5)
#: EP 2: each DP rank routes its own sample, padded (BSHD) to one length, since the
#: dispatcher's allgather over TP x EP needs equal shapes; TP 2 + SP: both ranks split one
#: THD stream of both samples.
GRIDS = {
    "ep2": {"tp": 1, "ep": 2, "packed": False, "seq_length": 8},
    "tp2_sp": {"tp": 2, "ep": 1, "packed": True, "seq_length": None},
}
DEADLINE_S = 240


# --- one rank -------------------------------------------------------------------------------


def _cpu_shims() -> None:
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter.gating = lambda self, hidden: torch.nn.functional.linear(hidden, self.weight)
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(1)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: torch.device("cpu")


def run(rank: int, port: int) -> dict:
    quiet_import_megatron()
    _cpu_shims()
    return on_each_grid(rank, WORLD, port, GRIDS, functools.partial(_grid, rank))


def _config(grid: dict, recompute: bool):
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    options = {
        "num_layers": 1,
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_ffn_hidden_size": HIDDEN,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_load_balancing_type": "none",
        "moe_enable_routing_replay": True,
        "use_cpu_initialization": True,
        "add_bias_linear": False,
        "params_dtype": torch.float32,
        "tensor_model_parallel_size": grid["tp"],
        "expert_model_parallel_size": grid["ep"],
        "sequence_parallel": grid["tp"] > 1,
    }
    if recompute:
        options |= {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**options)


def _layer(config):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(0)  # the same weights on every rank, with and without recompute
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
    return layer


def _engine_batch():
    """The inference side: distinct experts per token, one prime-rl envelope per sample
    (the last token's row is never sent), read back by ``r3data.loader``."""
    import r3data
    from r3data.wire import pack_ndarray

    generator = np.random.default_rng(7)
    samples = []
    for i, n in enumerate(LENGTHS):
        routes = np.stack([generator.permutation(EXPERTS)[:TOPK] for _ in range(n - 1)])
        envelope = pack_ndarray(routes[:, None, :].astype(np.uint8))
        source = {"producer": "prime-rl", "response": {"choices": [{"routed_experts": envelope}]}}
        request = {"prompt_len": 2, "completion_len": n - 2, "sources": [source]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    (batch,) = list(r3data.loader(samples, batch_size=len(samples), collate={"workers": 1}))
    return batch


def _local_routes(batch, config, grid) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's micro-batch (its DP share) laid out for it, and its real-token mask."""
    from megatron.core import parallel_state

    from r3data.layout import PAD, expand
    from r3data.replay import megatron_layout

    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    share = batch.slice(dp_rank, dp_rank + 1) if dp_size > 1 else batch
    layout = megatron_layout(config, packed=grid["packed"], seq_length=grid["seq_length"])
    real = torch.from_numpy(layout.token_index(share["routed_experts"].lengths) != PAD)
    return expand(share["routed_experts"], layout), real


def _replayed_step(layer, config, per_layer, hidden) -> dict:
    """One replayed forward and backward; what the router and the dispatcher saw."""
    from r3data.replay import replay_step

    maps, gathered, fifo = [], [], []
    layer.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].clone()))
    dispatcher = layer.token_dispatcher
    postprocess = dispatcher.dispatch_postprocess

    def capture(*args, **kwargs):
        gathered.append(dispatcher.routing_map.clone())
        return postprocess(*args, **kwargs)

    dispatcher.dispatch_postprocess = capture
    hidden = hidden.clone().requires_grad_(True)
    with replay_step(config, model=layer) as step:
        with step.forward(per_layer):
            output, _ = layer(hidden)
        fifo.append(len(layer.router.router_replay.replay_backward_list))
        (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
        fifo.append(len(layer.router.router_replay.replay_backward_list))
    return {
        "maps": list(maps),
        "gathered": list(gathered),
        "fifo": fifo,
        "output": output.detach(),
        "grads": [hidden.grad] + [p.grad for p in layer.parameters()],
    }


def _grid(rank: int, grid: dict) -> dict:
    from megatron.core import parallel_state

    batch = _engine_batch()
    recompute_config, plain_config = _config(grid, True), _config(grid, False)
    per_layer, real = _local_routes(batch, recompute_config, grid)
    (routes,) = per_layer
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(routes.shape[0], 1, HIDDEN, generator=generator)

    layer = _layer(recompute_config)
    recomputed = _replayed_step(layer, recompute_config, per_layer, hidden)
    plain = _replayed_step(_layer(plain_config), plain_config, per_layer, hidden)
    with torch.no_grad():
        _, own_map = layer.router(hidden)  # outside replay_step: the router's own top-k

    expected = torch.zeros(routes.shape[0], EXPERTS, dtype=torch.bool)
    expected.scatter_(1, routes.long(), True)
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    everyone = [torch.empty_like(expected) for _ in range(group.size())]
    torch.distributed.all_gather(everyone, expected, group=group)
    global_map = torch.cat(everyone)
    valid_rows = batch["routed_experts_valid"].values
    engine_rows = batch["routed_experts"].values[valid_rows][:, 0]
    return {
        "router_calls": [len(recomputed["maps"]), len(plain["maps"])],
        "router_maps_equal": all(
            torch.equal(m, expected) for m in recomputed["maps"] + plain["maps"]
        ),
        "own_map_differs": not torch.equal(own_map, expected),
        "padding_distinct": bool((expected[~real].sum(-1) == TOPK).all()),
        "gathered_calls": len(recomputed["gathered"]),
        "gathered_equal": all(torch.equal(m, global_map) for m in recomputed["gathered"]),
        "gathered_tokens": int(global_map.shape[0]),
        "fifo": recomputed["fifo"] + plain["fifo"],
        "outputs_equal": torch.equal(recomputed["output"], plain["output"]),
        "grads_equal": all(
            torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True)
        ),
        "router_grad": float(recomputed["grads"][1].abs().sum()),
        "engine_rows_distinct": bool(
            (engine_rows.sort(-1).values[:, 1:] != engine_rows.sort(-1).values[:, :-1]).all()
        ),
        "local_tokens": int(routes.shape[0]),
        "real_tokens": int(real.sum()),
    }


# --- the parent -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return spawn_ranks(run, WORLD, (free_port(),), DEADLINE_S)


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_moe_layer_replays_routes_forward_and_in_recompute(reports, grid):
    for rank, report in reports.items():
        case = report[grid]
        assert case["router_calls"] == [2, 1], rank  # forward + recompute; forward only
        assert case["own_map_differs"], rank  # the replay is not what the router would pick
        assert case["router_maps_equal"], rank
        assert case["padding_distinct"], rank
        assert case["gathered_calls"] == 2, rank
        assert case["gathered_equal"], rank
        assert case["fifo"] == [1, 0, 1, 1], rank  # recompute pops it; no recompute keeps it
        assert case["outputs_equal"], rank
        assert case["grads_equal"], rank
        assert case["router_grad"] > 0, rank
        assert case["engine_rows_distinct"], rank
    total = sum(LENGTHS)
    if grid == "ep2":  # each DP rank routes its own sample; the dispatcher gathers both
        assert sorted(r[grid]["real_tokens"] for r in reports.values()) == sorted(LENGTHS)
        assert all(r[grid]["local_tokens"] == 8 for r in reports.values())
        assert all(
            r[grid]["gathered_tokens"] == 2 * r[grid]["local_tokens"] for r in reports.values()
        )
    else:  # TP 2 + SP: each TP rank routes half of the (padded) stream
        assert sum(r[grid]["real_tokens"] for r in reports.values()) == total
        assert all(
            r[grid]["gathered_tokens"] == 2 * r[grid]["local_tokens"] for r in reports.values()
        )
