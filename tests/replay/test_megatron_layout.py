"""Layouts against megatron-core's own code (one process): the layers a hybrid model's
``MambaStack`` builds, and the tokens megatron's own CP split, SP scatter and router put in
each place of a rank.

Megatron's split functions read only their group's ``size()`` and ``rank()``; a ``Group`` of
the rank's coordinates lets one process run them for every rank of a grid (the real
multi-process groups run in ``test_replay_distributed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import EXPERTS, TOPK, distinct_routes, make_config, quiet_import_megatron

from r3data.errors import ReplayError
from r3data.layout import expand
from r3data.packed import PackedTensor
from r3data.replay import install, megatron_layout, model_layers, replay_step, router_replays

quiet_import_megatron()
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: E402


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


@dataclass
class StageOf:
    """What ``MambaStack._select_layers_for_pipeline_parallel`` reads of its stack."""

    config: object
    pp_group: Group


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
