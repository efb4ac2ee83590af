"""ModelLayers: MoE pattern and pipeline stages, checked against megatron-core's own rules."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import LayoutError
from r3data.layout import ModelLayers


def test_uniform_stages_split_contiguously():
    layers = ModelLayers(num_layers=8)
    assert [layers.stage(4, r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layers.stage(1, 0) == tuple(range(8))


def test_uneven_first_and_last_stages():
    layers = ModelLayers(num_layers=10, first_stage_layers=1, last_stage_layers=3)
    assert [layers.stage(4, r) for r in range(4)] == [(0,), (1, 2, 3), (4, 5, 6), (7, 8, 9)]


def test_explicit_stage_lists():
    layers = ModelLayers(num_layers=5, stage_layers=[[0, 1, 2], [3, 4]])
    assert layers.stage(2, 1) == (3, 4)
    with pytest.raises(LayoutError, match="lists 2 stages, pp_size is 3"):
        layers.stage(3, 0)


def test_moe_pattern_from_a_frequency_or_a_list():
    assert ModelLayers(num_layers=6, moe_layer_freq=2).moe_layer_ids == (0, 2, 4)
    pattern = ModelLayers(num_layers=4, moe_layer_freq=[0, 1, 1, 0])
    assert pattern.is_moe == (False, True, True, False)
    assert pattern.moe_stage(2, 0) == (1,)
    assert pattern.moe_stage(2, 1) == (2,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers: expected an int >= 1, found 0"),
        ({"num_layers": 3, "moe_layer_freq": [1, 0]}, "3 flags of 0 or 1"),
        ({"num_layers": 2, "moe_layer_freq": [1, 2]}, "2 flags of 0 or 1"),
        ({"num_layers": 2, "moe_layer_freq": 0}, "moe_layer_freq: expected an int >= 1"),
        ({"num_layers": 2, "first_stage_layers": -1}, "first_stage_layers: expected an int >= 0"),
        ({"num_layers": 3, "stage_layers": [[0, 2], [1]]}, "consecutive runs"),
        ({"num_layers": 3, "stage_layers": [[0, 1]]}, "consecutive runs"),
        ({"num_layers": 2, "stage_layers": [[0, 1], [1]]}, "consecutive runs"),
        (
            {"num_layers": 3, "stage_layers": [[0, 1, 2]], "first_stage_layers": 1},
            "either stage_layers or first/last",
        ),
    ],
)
def test_invalid_model_layers_raise(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ModelLayers(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "pp_size", "message"),
    [
        ({"num_layers": 7}, 2, "7 layers must split evenly over 2"),
        ({"num_layers": 6, "first_stage_layers": 2, "last_stage_layers": 2}, 2, "add up to"),
        ({"num_layers": 6, "first_stage_layers": 7}, 2, "add up to"),
    ],
)
def test_impossible_stage_splits_raise(kwargs, pp_size, message):
    with pytest.raises(LayoutError, match=message):
        ModelLayers(**kwargs).stage(pp_size, 0)


def test_stage_rank_is_checked():
    with pytest.raises(LayoutError, match=r"pp_rank must be in \[0, 2\), found 2"):
        ModelLayers(num_layers=4).stage(2, 2)


# --- against megatron-core ---------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.transformer import transformer_block, transformer_layer
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_config import TransformerConfig
    return {
        "config": TransformerConfig,
        "build": transformer_block.get_num_layers_to_build,
        "offset": transformer_layer.get_transformer_layer_offset,
        "specs": gpt_layer_specs.get_gpt_decoder_layer_specs,
        "moe": MoELayer,
    }


@st.composite
def pipelines(draw):
    """A pipeline megatron accepts: (pp_size, num_layers, first, last, MoE pattern)."""
    pp_size = draw(st.integers(2, 4))
    first = draw(st.one_of(st.none(), st.integers(1, 4)))
    last = draw(st.one_of(st.none(), st.integers(1, 4)))
    middle = pp_size - (first is not None) - (last is not None)
    num_layers = draw(st.integers(1, 3)) * middle + (first or 0) + (last or 0)
    pattern = draw(st.lists(st.sampled_from([0, 1]), min_size=num_layers, max_size=num_layers))
    return pp_size, num_layers, first, last, pattern


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=30, deadline=None)
@given(pipeline=pipelines())
def test_stages_and_moe_layers_match_megatron(megatron, pipeline):
    pp_size, num_layers, first, last, pattern = pipeline
    config = megatron["config"](
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_layer_freq=pattern,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    layers = ModelLayers(
        num_layers=num_layers,
        moe_layer_freq=pattern,
        first_stage_layers=first,
        last_stage_layers=last,
    )
    specs = megatron["specs"](config, use_transformer_engine=False)
    assert layers.is_moe == tuple(spec.submodules.mlp.module is megatron["moe"] for spec in specs)
    for pp_rank in range(pp_size):
        offset = megatron["offset"](config, pp_rank=pp_rank)
        count = megatron["build"](config, pp_rank=pp_rank)
        assert layers.stage(pp_size, pp_rank) == tuple(range(offset, offset + count))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_integer_moe_frequency_matches_megatron(megatron):
    config = megatron["config"](
        num_layers=7, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_layer_freq=3
    )
    specs = megatron["specs"](config, use_transformer_engine=False)
    expected = tuple(spec.submodules.mlp.module is megatron["moe"] for spec in specs)
    assert ModelLayers(num_layers=7, moe_layer_freq=3).is_moe == expected
