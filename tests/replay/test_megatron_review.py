"""Review of the megatron replay path against real megatron-core routers (one process): inputs
that megatron would take silently or fail on untyped, and forwards the step took for recompute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import (
    EXPERTS,
    TOPK,
    build_routers,
    distinct_routes,
    make_config,
    quiet_import_megatron,
    routing_map,
)

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))

from r3data.errors import ReplayError
from r3data.replay import check_config, install, replay_step, router_replays
from r3data.replay.megatron import check_routes

quiet_import_megatron()
from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay,
    RouterReplayAction,
)


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Every test here runs in the one-process megatron world."""


def routes_for(tokens: int, width: int = TOPK, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [distinct_routes(tokens, width, EXPERTS, generator) for _ in range(3)]


def logits(tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, 1, EXPERTS, generator=torch.Generator().manual_seed(seed))


def fifos_empty(routers) -> bool:
    return all(r.router_replay.replay_backward_list == [] for r in routers)


def test_routes_without_experts_are_refused_typed(routers):
    with pytest.raises(ReplayError, match=r"routes\[0\] must hold at least one expert per row"):
        install([torch.zeros(4, 0, dtype=torch.int32)] * 3, num_experts=EXPERTS)
    assert fifos_empty(routers)


def test_routes_of_another_width_are_refused_without_topk(routers):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routes = routes_for(4)
    routes[1] = routes_for(4, width=3)[1]
    RouterReplay.set_replay_data(routes)  # what megatron alone does with them
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, mapping = routers[1].routing(logits(4))
    assert mapping.sum(dim=1).tolist() == [3] * 4  # a top-2 router sent each token to 3 experts
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    message = r"routes\[1\] must hold top-2 rows like routes\[0\], found 3"
    with pytest.raises(ReplayError, match=message):
        install(routes, num_experts=EXPERTS)
    assert fifos_empty(routers)


def test_routes_on_another_device_are_refused_typed(routers):
    routes = routes_for(4)
    routes[2] = routes[2].to("meta")
    with pytest.raises(
        ReplayError, match=r"routes\[2\] must be on cpu like routes\[0\], found meta"
    ):
        install(routes, num_experts=EXPERTS, topk=TOPK)
    assert fifos_empty(routers)


@pytest.mark.parametrize("num_experts", [True, None, 0, 8.0])
def test_num_experts_must_be_a_positive_int(routers, num_experts):
    with pytest.raises(ReplayError, match=r"num_experts: expected an int >= 1, found"):
        install(routes_for(4), num_experts=num_experts, topk=TOPK)
    assert fifos_empty(routers)


def test_a_forward_without_grad_after_the_step_forward_is_no_recompute(config, routers):
    # recompute runs with grad enabled (it must build the graph for backward); a no_grad
    # forward outside step.forward would replay the previous micro-batch's routes
    def stray_forward():
        with replay_step(config) as step:
            with step.forward(routes_for(4)):
                for router in routers:
                    router.routing(logits(4))
            with torch.no_grad():
                routers[0].routing(logits(4, seed=2))

    with pytest.raises(
        ReplayError, match=r"router 0: a forward without grad outside step\.forward"
    ):
        stray_forward()
    assert fifos_empty(routers)


def test_a_recompute_with_grad_still_replays_in_order(config, routers):
    first, second = routes_for(4, seed=0), routes_for(4, seed=1)
    with replay_step(config) as step:
        for routes in (first, second):
            with step.forward(routes), torch.no_grad():  # a full-recompute forward: no grad
                for router in routers:
                    router.routing(logits(4))
        for routes in (first, second):
            for router, layer in zip(routers, routes, strict=True):
                _, mapping = router.routing(logits(4, seed=3))
                assert torch.equal(mapping, routing_map(layer, EXPERTS))
    assert fifos_empty(routers)


CHECK_REPLAY_CASES = """
import json, torch
from r3data.replay.megatron_check import check_replay
good = torch.tensor([[0, 1], [2, 3]])
cases = {
    "one_dim": ([torch.zeros(4, dtype=torch.long)], {}),
    "float_ids": ([torch.tensor([[0.0, 1.5]])], {}),
    "too_few_layers": ([good, good], {"num_layers": 1}),
    "no_experts": ([good], {"num_experts": 0}),
    "good": ([good.to(torch.uint8), good], {}),
}
outcomes = {}
for name, (routes, options) in cases.items():
    outcome = check_replay(routes, **{"num_experts": 8, **options})
    outcomes[name] = [outcome.status, outcome.detail]
with torch.no_grad():  # a caller without grad: the recompute it stands in for has grad
    outcomes["under_no_grad"] = [check_replay([good], num_experts=8).status, ""]
print(json.dumps(outcomes))
"""


def test_check_replay_refuses_bad_routes_with_a_failed_outcome():
    # check_replay builds its own process group: run it where none exists
    done = subprocess.run(
        [sys.executable, "-c", CHECK_REPLAY_CASES],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes["one_dim"] == [
        "failed",
        "routes[0] must be a [tokens, topk] tensor, found (4,)",
    ]
    assert outcomes["float_ids"][0] == "failed"  # not truncated to expert 1 and "verified"
    assert "found torch.float32" in outcomes["float_ids"][1]
    assert outcomes["too_few_layers"] == [
        "failed",
        "num_layers: expected an int >= 2, found 1",
    ]
    assert outcomes["no_experts"] == ["failed", "num_experts: expected an int >= 1, found 0"]
    assert outcomes["good"][0] == "verified"
    assert outcomes["under_no_grad"][0] == "verified"


@pytest.mark.parametrize("recompute", [False, True])
def test_routes_installed_behind_the_steps_back_fail_on_exit(config, routers, recompute):
    # a second install inside step.forward: the forward replays it, the recompute pops the
    # step's own routes, and the FIFO ends the step holding one entry more than it should
    def step_with_an_extra_install():
        with replay_step(config) as step:
            with step.forward(routes_for(4, seed=0)):
                RouterReplay.set_replay_data(routes_for(4, seed=1))
                for router in routers:
                    router.routing(logits(4))
            if recompute:
                for router in routers:
                    router.routing(logits(4))

    with pytest.raises(
        ReplayError, match=r"router 0: expected its backward FIFO to hold \d entries .*, found \d"
    ):
        step_with_an_extra_install()
    assert fifos_empty(routers)


def test_a_step_inside_a_step_is_refused(config, routers):
    with replay_step(config) as outer:
        message = r"routers \[0, 1, 2\] are in another replay step"
        with pytest.raises(ReplayError, match=message), replay_step(config):
            pass
        with outer.forward(routes_for(4)):  # the outer step still counts its routers
            for router in routers:
                router.routing(logits(4))
    assert fifos_empty(routers)


@pytest.mark.parametrize("model", ["policy", [torch.nn.Linear(2, 2), object()], 3])
def test_a_model_that_is_no_module_is_refused_typed(config, routers, model):
    with pytest.raises(ReplayError, match=r"model: expected a torch\.nn\.Module or a sequence"):
        router_replays(model)
    with pytest.raises(ReplayError, match="model: expected"), replay_step(config, model=model):
        pass


def test_one_stacked_tensor_is_no_list_of_layers(routers):
    # [tokens, layers, topk] with as many tokens as routers would give router i token i's rows
    stacked = torch.stack(routes_for(3), dim=1)
    with pytest.raises(ReplayError, match="expected a sequence of per-layer tensors, found Tensor"):
        install(stacked, num_experts=EXPERTS, topk=TOPK)
    with pytest.raises(ReplayError, match="found generator"):
        install((t for t in routes_for(3)), num_experts=EXPERTS, topk=TOPK)
    with pytest.raises(ReplayError, match="expected a sequence of per-layer tensors"):
        check_routes(stacked, num_experts=EXPERTS, topk=TOPK)  # its rows would pass as layers
    assert fifos_empty(routers)


@pytest.mark.parametrize(
    ("impl", "scope", "refused"),
    [
        ("local", [], True),  # an empty scope is the whole layer, router included
        ("transformer_engine", ["moe_router", "moe_preprocess"], True),
        ("local", ["full_iteration"], True),
        ("transformer_engine", ["moe"], True),
        ("transformer_engine", ["attn"], False),
        ("none", [], False),
    ],
)
def test_cuda_graphs_that_capture_the_router_are_refused(impl, scope, refused):
    # a captured router replays its kernels, never RouterReplay: later installs are not read
    from megatron.core.transformer.enums import CudaGraphScope

    from r3data.replay import check_config

    config = make_config()
    config.cuda_graph_impl = impl  # set after validation: capture needs CUDA and TE
    config.cuda_graph_scope = [CudaGraphScope[name] for name in scope]
    if refused:
        with pytest.raises(ReplayError, match=f"found cuda_graph_impl='{impl}'"):
            check_config(config)
    else:
        check_config(config)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_layers": 5, "moe_layer_freq": 2},
        {"num_layers": 6, "moe_layer_freq": 3},
        {"num_layers": 4, "moe_layer_freq": [0, 0, 1, 1]},  # first-k-dense
        {"num_layers": 8, "moe_layer_freq": [0, 1] * 4, "pipeline_model_parallel_size": 2},
        {
            "num_layers": 7,
            "moe_layer_freq": [0] + [1] * 6,
            "pipeline_model_parallel_size": 3,
            "num_layers_in_first_pipeline_stage": 1,
        },
        {
            "num_layers": 6,
            "moe_layer_freq": 2,
            "pipeline_model_parallel_size": 4,
            "account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True,
        },
    ],
)
def test_model_layers_name_the_routers_megatron_builds_on_each_stage(overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from r3data.replay import model_layers

    pp = overrides.get("pipeline_model_parallel_size", 1)
    config = make_config(**overrides, **({"pipeline_dtype": torch.float32} if pp > 1 else {}))
    layers = model_layers(config)
    for rank in range(pp):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=rank)
        built = [s.submodules.mlp.module is MoELayer for s in spec.layer_specs]
        stage = layers.stage(pp, rank)
        assert len(built) == len(stage)
        assert [i for i, moe in zip(stage, built, strict=True) if moe] == list(
            layers.moe_stage(pp, rank)
        )


def test_a_one_forward_one_backward_schedule_recomputes_each_micro_batch_in_turn(config, routers):
    # 1F1B: F1 F2 B1 F3 B2 B3; each recompute must see its own micro-batch's routes
    batches = [routes_for(4, seed=seed) for seed in range(3)]

    def recompute(batch):
        for router, layer in zip(routers, batch, strict=True):
            _, mapping = router.routing(logits(4, seed=9))
            assert torch.equal(mapping, routing_map(layer, EXPERTS))

    with replay_step(config) as step:
        for k, batch in enumerate(batches):
            with step.forward(batch):
                for router in routers:
                    router.routing(logits(4))
            if k >= 1:
                recompute(batches[k - 1])
        recompute(batches[-1])
    assert fifos_empty(routers)


def test_a_step_config_with_more_experts_than_the_routers_is_refused(routers):
    # ids checked against 16 experts would index past a router's 8 scores (a device-side
    # assert on CUDA)
    generator = torch.Generator().manual_seed(0)
    routes = [distinct_routes(4, TOPK, 16, generator) for _ in range(3)]
    message = r"router 0 scores 8 experts, the routes were checked against num_experts=16"
    with (
        pytest.raises(ReplayError, match=message),
        replay_step(make_config(num_moe_experts=16)) as step,
        step.forward(routes),
    ):
        routers[0].routing(logits(4))
    assert fifos_empty(routers)


def test_a_capacity_factor_that_can_drop_replayed_routes_is_refused(routers):
    # megatron drops assignments over an expert's capacity after replay
    # (apply_router_token_dropping): the router then routes tokens to fewer experts than the
    # engine did, and padding rows take capacity from real tokens
    dropping = make_config(moe_expert_capacity_factor=0.5)
    (router,) = build_routers(dropping, [1])  # cleared with the fixture's routers
    routes = routes_for(16)[0]
    router.router_replay.set_target_indices(routes)
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, mapping = router.routing(logits(16))
    assert not torch.equal(mapping, routing_map(routes, EXPERTS))  # what replay would give
    with pytest.raises(
        ReplayError, match=r"moe_expert_capacity_factor=0.5 can drop .* moe_router_topk = 4"
    ):
        check_config(dropping)
    check_config(make_config(moe_expert_capacity_factor=4.0))  # capacity >= tokens: no drop


def test_overlapped_expert_parallel_schedules_are_refused():
    # combined_1f1b runs a micro-batch's layers after forward_step_func returns its schedule
    # plan, interleaved with another micro-batch's backward: no step.forward holds them
    config = make_config()
    config.overlap_moe_expert_parallel_comm = True  # set after validation: it needs EP and bf16
    with pytest.raises(ReplayError, match="overlap_moe_expert_parallel_comm must be False"):
        check_config(config)
