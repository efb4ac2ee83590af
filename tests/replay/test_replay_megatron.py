"""Installing routes into real megatron-core routers and the replay-step protocol (one process).

The routers are real ``TopKRouter``s under a real single-rank gloo process group with
megatron's ``parallel_state`` initialised; ``router.routing(logits)`` runs megatron's own
top-k path (``TopKRouter.forward`` would move the weights to CUDA).
"""

from __future__ import annotations

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
from r3data.layout import ModelLayers, TokenLayout
from r3data.replay import (
    check_config,
    install,
    megatron_layout,
    model_layers,
    replay_step,
    router_replays,
)

quiet_import_megatron()
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay,
)


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Every test here runs in the one-process megatron world."""


def routes_for(
    tokens: int, layers: int = 3, seed: int = 0, dtype=torch.int32
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [distinct_routes(tokens, TOPK, EXPERTS, generator).to(dtype) for _ in range(layers)]


def logits(seq: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(seq, batch, EXPERTS, generator=torch.Generator().manual_seed(seed))


def assert_clean(routers) -> None:
    for router in routers:
        replay = router.router_replay
        assert replay.target_topk_idx is None
        assert replay.replay_backward_list == []
        assert replay.router_replay_action is None
        assert "get_replay_topk" not in vars(replay)


def test_forward_and_recompute_replay_the_installed_routes(config, routers):
    first, second = routes_for(6, seed=0), routes_for(6, seed=1)
    with replay_step(config) as step:
        for routes in (first, second):
            with step.forward(routes):
                for router, layer in zip(routers, routes, strict=True):
                    probs, mapping = router.routing(logits(3, 2))
                    assert torch.equal(mapping, routing_map(layer, EXPERTS))
                    assert torch.all((probs > 0) == mapping)
        for routes in (first, second):  # recompute in backward pops the FIFO in forward order
            for router, layer in zip(routers, routes, strict=True):
                _, mapping = router.routing(logits(6, 1, seed=5))
                assert torch.equal(mapping, routing_map(layer, EXPERTS))
    assert_clean(routers)


def test_forward_only_steps_need_no_recompute(config, routers):
    with replay_step(config) as step, step.forward(routes_for(4, dtype=torch.int64)):
        for router in routers:
            router.routing(logits(4))
    assert_clean(routers)


def test_replay_differs_from_the_routers_own_choice(config, routers):
    scores = logits(64)
    _, own = routers[0].routing(scores)
    routes = routes_for(64, seed=7)
    with replay_step(config) as step, step.forward(routes):
        replayed = [router.routing(scores)[1] for router in routers]
    assert not torch.equal(own, replayed[0])
    assert torch.equal(replayed[0], routing_map(routes[0], EXPERTS))


def route_all(routers, tokens: int) -> None:
    for router in routers:
        router.routing(logits(tokens))


def test_a_forward_that_skips_installed_routes_fails_on_exit(config, routers):
    def step_with_a_skipped_forward():
        with replay_step(config) as step:
            with step.forward(routes_for(4)):
                route_all(routers, 4)
            with step.forward(routes_for(4)):
                pass

    with pytest.raises(ReplayError, match="2 micro-batches installed but 1 replayed forwards"):
        step_with_a_skipped_forward()
    assert_clean(routers)


def test_a_partial_recompute_fails_on_exit(config, routers):
    def step_with_one_recompute():
        with replay_step(config) as step:
            for seed in (0, 1):
                with step.forward(routes_for(4, seed=seed)):
                    route_all(routers, 4)
            route_all(routers, 4)

    with pytest.raises(ReplayError, match="recomputed 1 of 2 micro-batches"):
        step_with_one_recompute()
    assert_clean(routers)


def test_recompute_past_the_fifo_raises(config, routers):
    def step_with_two_recomputes():
        with replay_step(config) as step:
            with step.forward(routes_for(4)):
                routers[0].routing(logits(4))
            routers[0].routing(logits(4))
            routers[0].routing(logits(4))

    with pytest.raises(ReplayError, match="recompute #2 found no routes left"):
        step_with_two_recomputes()
    assert_clean(routers)


def test_routing_without_replay_inside_a_step_fails(config, routers):
    with pytest.raises(ReplayError, match="routed 1 times without replay"), replay_step(config):
        routers[0].routing(logits(4))
    assert_clean(routers)


def test_routes_that_do_not_fit_the_tokens_raise_in_forward(config, routers):
    message = r"routes 6 tokens with top-2, the installed routes are \[5, 2\]"
    with (
        pytest.raises(ReplayError, match=message),
        replay_step(config) as step,
        step.forward(routes_for(5)),
    ):
        routers[0].routing(logits(3, 2))
    assert_clean(routers)


def test_an_aborted_step_leaves_nothing_stale(config, routers):
    def aborted_step():
        with replay_step(config) as step, step.forward(routes_for(4)):
            routers[0].routing(logits(4))
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        aborted_step()
    assert_clean(routers)
    with replay_step(config) as step, step.forward(routes_for(2)):
        route_all(routers, 2)


def test_stale_routes_from_outside_a_step_are_refused(config, routers):
    RouterReplay.set_replay_data(routes_for(4))
    with pytest.raises(ReplayError, match=r"routers \[0, 1, 2\] hold routes"), replay_step(config):
        pass


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        (routes_for(4, layers=2), "one routes tensor per local router .* found 2"),
        (
            routes_for(4, dtype=torch.uint8),
            r"int32 or int64 \(torch.gather indices\), found torch.uint8",
        ),
        ([torch.zeros(4, dtype=torch.int32)] * 3, r"\[tokens, topk\] tensor, found \(4,\)"),
        ([torch.zeros(4, 3, dtype=torch.int32)] * 3, "top-2 rows, found 3"),
        (routes_for(4)[:2] + routes_for(5)[:1], "must hold 4 tokens like routes"),
        (
            [*routes_for(4)[:2], torch.tensor([[0, 8]] * 4)],
            r"routes\[2\] expert ids must be in \[0, 8\), found 8",
        ),
        ([torch.tensor([[-1, 0]])] * 3, "found -1"),
        (
            routes_for(4)[:1] + [torch.tensor([[3, 3]] * 4)] * 2,
            r"routes\[1\] has a row that repeats",
        ),
        ([None, None, None], "tensor, found NoneType"),
    ],
)
def test_install_refuses_bad_routes(routers, routes, message):
    with pytest.raises(ReplayError, match=message):
        install(routes, num_experts=EXPERTS, topk=TOPK)
    assert all(r.router_replay.replay_backward_list == [] for r in routers)


def test_install_feeds_one_model_among_several(config, routers):
    other = torch.nn.ModuleList(build_routers(config, [1, 2]))
    assert len(RouterReplay.global_router_replay_instances) == 5
    with pytest.raises(ReplayError, match="5 RouterReplay instances"):
        install(routes_for(4), num_experts=EXPERTS)
    assert router_replays(other) == [r.router_replay for r in other]
    with replay_step(config, model=[other]) as step, step.forward(routes_for(4, layers=2)):
        for router in other:
            router.routing(logits(4))
    assert all(r.router_replay.replay_backward_list == [] for r in routers)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"moe_enable_routing_replay": False}, "moe_enable_routing_replay must be True"),
        ({"moe_router_fusion": True}, "fused top-k router ignores RouterReplay"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "'sinkhorn' never consults"),
        ({"moe_router_force_load_balancing": True}, "replaces the logits"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size=2"),
    ],
)
def test_configs_megatron_would_not_replay_are_refused(overrides, message):
    config = make_config()
    for name, value in overrides.items():
        setattr(config, name, value)  # set after validation: some need Transformer Engine
    with pytest.raises(ReplayError, match=message):
        check_config(config)


def test_layout_and_layers_come_from_megatron():
    config = make_config(num_layers=4, moe_layer_freq=[1, 0, 1, 1], sequence_parallel=False)
    layout = megatron_layout(config, packed=False, padding_side="left")
    assert layout == TokenLayout(
        packed=False,
        padding_side="left",
        layers=ModelLayers(num_layers=4, moe_layer_freq=(1, 0, 1, 1), stage_layers=((0, 1, 2, 3),)),
    )
    assert model_layers(make_config(moe_layer_freq=2)).moe_layer_ids == (0, 2)


@pytest.mark.parametrize(
    "name", ["tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size"]
)
def test_a_config_of_other_parallel_sizes_than_the_state_is_refused(name):
    config = make_config(sequence_parallel=False)
    setattr(config, name, 2)  # the world is of one process: every size is 1
    with pytest.raises(ReplayError, match=f"config.{name} must be parallel_state's 1 .* found 2"):
        megatron_layout(config, packed=True)


def test_a_config_with_hybrid_context_parallel_is_refused():
    # megatron's scheduler then gives each sub-sample a CP group of its own size, which the
    # static layout of parallel_state's CP group would not follow
    config = make_config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64)
    with pytest.raises(ReplayError, match=r"hybrid_context_parallel must be False .* found True"):
        megatron_layout(config, packed=True)


def test_a_layout_before_initialize_model_parallel_is_refused():
    config = make_config(sequence_parallel=False)
    parallel_state.destroy_model_parallel()
    try:
        with pytest.raises(ReplayError, match=r"initialize_model_parallel.*found none"):
            megatron_layout(config, packed=True)
    finally:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    assert megatron_layout(config, packed=True).tp_size == 1


def test_importing_r3data_replay_does_not_import_megatron():
    code = (
        "import sys, r3data.replay, r3data.layout\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'megatron'], 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bshd_layout_without_cp_equals_megatron_cp_slicing():
    from megatron.core.utils import get_batch_on_this_cp_rank

    layout = TokenLayout(packed=False, padding_side="left")
    lengths = [5, 0, 9]
    tokens = torch.from_numpy(layout.token_grid(lengths).T.copy())
    assert parallel_state.get_context_parallel_world_size() == 1
    assert torch.equal(get_batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"], tokens)


def test_a_custom_pipeline_layout_sets_the_stages():
    config = make_config(
        num_layers=5,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_layout=[["embedding", "decoder"], ["decoder"] * 4 + ["loss"]],
    )
    assert model_layers(config).stage_layers == ((0,), (1, 2, 3, 4))


def test_an_empty_micro_batch_installs_without_value_checks(routers):
    empty = [torch.zeros(0, TOPK, dtype=torch.int32)] * 3
    install(empty, num_experts=EXPERTS, topk=TOPK)
    assert all(r.router_replay.target_topk_idx is empty[0] for r in routers)
