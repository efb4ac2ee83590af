"""Layouts against megatron-core's own code (one process): the layers a hybrid model's
``MambaStack`` builds, and the tokens megatron's own CP split, SP scatter and router put in
each place of a rank.

Megatron's split functions read only their group's ``size()`` and ``rank()``; a ``Group`` of
the rank's coordinates lets one process run them for every rank of a grid (the real
multi-process groups run in ``test_replay_distributed.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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

from r3data.errors import ReplayError
from r3data.layout import PAD, TokenLayout, expand
from r3data.packed import PackedTensor
from r3data.replay import install, megatron_layout, model_layers, replay_step, router_replays

quiet_import_megatron()
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules  # noqa: E402
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Every test here runs in the one-process megatron world."""


@dataclass(frozen=True)
class Group:
    """One rank's place in a process group: all megatron's splitting reads of it."""

    world: int
    place: int

    def size(self) -> int:
        return self.world

    def rank(self) -> int:
        return self.place


@pytest.fixture(scope="module")
def router():
    """One real ``TopKRouter``, routing by its own top-k (no replay action set)."""
    RouterReplay.clear_global_router_replay_instances()
    (built,) = build_routers(make_config(), [1])
    yield built
    RouterReplay.clear_global_router_replay_instances()


@dataclass
class StageOf:
    """What ``MambaStack._select_layers_for_pipeline_parallel`` reads of its stack."""

    config: object
    pp_group: Group


# --- tokens: megatron's CP split, SP scatter and router against the layout ------------------


@st.composite
def grids(draw):
    """A micro-batch and a (TP, CP) grid megatron splits: BSHD with any CP, THD without CP
    (megatron's THD split is Transformer Engine's; its rule is in ``layout_reference``)."""
    packed = draw(st.booleans())
    tp, cp = draw(st.sampled_from([1, 2, 4])), 1 if packed else draw(st.sampled_from([1, 2, 4]))
    sp = tp > 1 and draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 24), min_size=1, max_size=3))
    side = "right" if packed else draw(st.sampled_from(["right", "left"]))
    scale = draw(st.integers(1, 2))
    extra = None if packed else draw(st.one_of(st.none(), st.integers(0, 1)))  # seq_length
    return tp, cp, sp, packed, side, lengths, scale, extra


def _megatron_places(grid, tp, tp_rank, cp, cp_rank, sp) -> torch.Tensor:
    """``[B, S]`` token ids as megatron carries them to a router: CP split of the sequence
    dimension, ``[s, b]``, SP scatter of the first dimension."""
    local = get_batch_on_this_cp_rank({"tokens": grid}, cp_group=Group(cp, cp_rank))["tokens"]
    hidden = local.T.contiguous()
    if sp:
        hidden = scatter_to_sequence_parallel_region(hidden, group=Group(tp, tp_rank))
    return hidden


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=25, deadline=None)
@given(case=grids())
def test_each_router_place_holds_the_token_megatron_puts_there(router, case):
    tp, cp, sp, packed, side, lengths, scale, extra = case
    generator = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    rows = distinct_routes(total, TOPK, EXPERTS, generator)
    routes = PackedTensor.from_lengths(rows[:, None], lengths)
    multiple = scale * math.lcm(2 * cp if cp > 1 else 1, cp * (tp if sp else 1))  # the least
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    if packed:  # one stream: every sample padded on the right to its own multiple
        stream = [
            s + p if p < n else PAD
            for s, n in zip(starts, lengths, strict=True)
            for p in range(-(-n // multiple) * multiple)
        ]
        grid = torch.tensor([stream], dtype=torch.int64)
    else:  # every sample padded to the longest, rounded up, or to a fixed seq_length
        width = -(-max(lengths) // multiple) * multiple + (extra or 0) * multiple
        grid = torch.full((len(lengths), width), PAD, dtype=torch.int64)
        for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
            at = width - n if side == "left" else 0
            grid[b, at : at + n] = torch.arange(s, s + n)
    for tp_rank in range(tp):
        for cp_rank in range(cp):
            layout = TokenLayout(
                tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp, cp_size=cp, cp_rank=cp_rank,
                packed=packed, padding_side=side, pad_multiple=multiple,
                seq_length=None if extra is None else width,
            )  # fmt: skip
            places = _megatron_places(grid, tp, tp_rank, cp, cp_rank, sp)  # [s, b]
            # each token's logits favour its engine routes: the router's own top-k names them
            logits = torch.randn(*places.shape, EXPERTS, generator=generator)
            real = places >= 0
            logits[real] += 10 * routing_map(rows[places[real]], EXPERTS)
            with torch.no_grad():
                _, mapping = router.routing(logits)
            (replayed,) = expand(routes, layout)
            flat = real.reshape(-1)
            assert torch.equal(mapping[flat], routing_map(replayed, EXPERTS)[flat]), layout
            assert torch.equal(torch.from_numpy(layout.token_index(lengths) != PAD), flat)


# --- hybrid models -------------------------------------------------------------------------


def _mamba_stack(config, pattern: str):
    """A real ``MambaStack`` of ``pattern``: MoE layers ('E') built, other symbols identity."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    submodules = MambaStackSubmodules(moe_layer=get_gpt_layer_local_spec(num_experts=8))
    RouterReplay.clear_global_router_replay_instances()
    try:
        return MambaStack(
            config,
            submodules,
            hybrid_override_pattern=pattern,
            post_layer_norm=False,  # TENorm needs Transformer Engine
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    finally:
        RouterReplay.clear_global_router_replay_instances()


def test_a_hybrid_model_takes_its_moe_layers_from_its_pattern():
    pattern = "*E-EM"
    config = make_config(num_layers=len(pattern), is_hybrid_model=True)
    stack = _mamba_stack(config, pattern)
    built = tuple(
        i for i, layer in enumerate(stack.layers) if hasattr(getattr(layer, "mlp", None), "router")
    )
    layers = model_layers(config, hybrid_override_pattern=pattern)
    assert built == layers.moe_stage(1, 0) == (1, 3)
    layout = megatron_layout(config, packed=True, hybrid_override_pattern=pattern)
    assert layout.layers == layers


@pytest.mark.parametrize(
    ("pattern", "pp", "first", "last"),
    [
        ("E*E-E*", 2, None, None),
        ("*EEE-E", 3, None, None),
        ("E-E*EE*", 3, 1, None),
        ("*E-EE", 3, None, 1),
        ("EE*E-E", 3, 2, 2),
    ],
)
def test_hybrid_pipeline_stages_are_the_mamba_stacks(pattern, pp, first, last):
    config = make_config(
        num_layers=len(pattern),
        is_hybrid_model=True,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    layers = model_layers(config, hybrid_override_pattern=pattern)
    for rank in range(pp):
        stage = StageOf(config, Group(pp, rank))
        offset, kinds = MambaStack._select_layers_for_pipeline_parallel(stage, list(pattern))
        assert layers.stage(pp, rank) == tuple(range(offset, offset + len(kinds)))
        assert layers.moe_stage(pp, rank) == tuple(
            offset + i for i, kind in enumerate(kinds) if kind == "E"
        )


def test_a_hybrid_model_without_its_pattern_or_with_a_bad_one_is_refused():
    config = make_config(num_layers=4, is_hybrid_model=True)
    with pytest.raises(ReplayError, match=r"is_hybrid_model.*hybrid_override_pattern.*found None"):
        model_layers(config)
    with pytest.raises(ReplayError, match=r"is_hybrid_model.*hybrid_override_pattern.*found None"):
        megatron_layout(config, packed=True)
    with pytest.raises(ReplayError, match=r"hybrid_override_pattern 'E\*E': .*wrong length"):
        model_layers(config, hybrid_override_pattern="E*E")
    with pytest.raises(ReplayError, match=r"hybrid_override_pattern 'E\*EX': .*'X'"):
        model_layers(config, hybrid_override_pattern="E*EX")


# --- multi-token prediction ----------------------------------------------------------------


def test_with_mtp_layers_the_decoder_takes_the_routes_and_mtp_routes_itself():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    config = make_config(moe_layer_freq=[0, 1, 1], mtp_num_layers=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    RouterReplay.clear_global_router_replay_instances()
    try:
        model = GPTModel(config, spec, vocab_size=16, max_sequence_length=8, mtp_block_spec=mtp)
        generator = torch.Generator().manual_seed(0)
        rows = torch.stack([distinct_routes(5, TOPK, EXPERTS, generator) for _ in range(3)], 1)
        per_layer = expand(
            PackedTensor.from_lengths(rows, [5]), megatron_layout(config, packed=True)
        )
        assert len(per_layer) == 2 == len(router_replays(model.decoder))
        assert len(RouterReplay.global_router_replay_instances) == 3  # the MTP layer's too
        with pytest.raises(ReplayError, match="3 RouterReplay instances"):
            install(per_layer, num_experts=EXPERTS)
        with replay_step(config, model=model.decoder) as step, step.forward(per_layer):
            for layer, routes in zip(model.decoder.layers[1:], per_layer, strict=True):
                _, mapping = layer.mlp.router.routing(torch.randn(5, 1, EXPERTS))
                assert torch.equal(
                    mapping.nonzero()[:, 1].view(5, TOPK), routes.sort(1).values.long()
                )
            model.mtp.layers[0].transformer_layer.mlp.router.routing(torch.randn(5, 1, EXPERTS))
    finally:
        RouterReplay.clear_global_router_replay_instances()
