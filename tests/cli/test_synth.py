"""Synthetic rollouts: model shapes, routes, multi-turn lengths, producer bodies, expert load."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, WireFormatError
from r3data.nodes.sample import source_rows
from r3data.synth import (
    INLINE_PRODUCERS,
    LENGTH_DISTRIBUTIONS,
    MODEL_SHAPES,
    ModelShape,
    SyntheticRouter,
    draw_lengths,
    model_shape,
    request_source,
    serve_rollouts,
    synth_rollouts,
)
from r3data.synth.expert_load import expert_load


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_model_shapes_agree_with_their_layout(name):
    shape = model_shape(name)
    assert shape.layers.moe_layer_ids == shape.moe_layer_ids
    assert len(shape.moe_layer_ids) == shape.num_layers - shape.dense_layers
    assert np.iinfo(shape.route_dtype).max >= shape.num_experts - 1
    assert shape.route_bytes_per_token == np.prod(shape.row_shape) * shape.route_dtype.itemsize


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ConfigError, match="qwen3-30b-a3b"):
        model_shape("gpt-2")


@settings(max_examples=30, deadline=None)
@given(
    layers=st.integers(1, 6),
    dense=st.integers(0, 2),
    experts=st.integers(2, 300),
    data=st.data(),
)
def test_routes_name_distinct_experts_in_moe_layers_and_zero_in_dense(layers, dense, experts, data):
    dense = min(dense, layers - 1)
    topk = data.draw(st.integers(1, min(experts, 8)))
    tokens = data.draw(st.integers(0, 50))
    shape = ModelShape("test", layers, experts, topk, dense)
    routes = SyntheticRouter(shape, seed=data.draw(st.integers(0, 9))).route(
        tokens, np.random.default_rng(0)
    )
    assert routes.shape == (tokens, layers, topk)
    assert routes.dtype == shape.route_dtype
    assert not routes[:, :dense].any()
    moe = routes[:, dense:].astype(np.int64)
    assert moe.size == 0 or moe.max() < experts
    ordered = np.sort(moe, axis=-1)
    assert not (ordered[..., 1:] == ordered[..., :-1]).any()


def test_rollouts_are_multi_turn_extensions_with_routes_for_every_forwarded_token():
    shape = MODEL_SHAPES["deepseek-v3"]
    rollouts = synth_rollouts(SyntheticRouter(shape), 20, seed=1, max_turns=4, max_len=6000)
    assert any(len(r.requests) > 1 for r in rollouts)
    for rollout in rollouts:
        total = 0
        spans = []
        for j, (prompt_len, completion_len) in enumerate(rollout.requests):
            assert prompt_len > total
            assert completion_len >= 1
            total = prompt_len + completion_len
            spans.append(rollout.route_span(j))
        assert total == rollout.tokens <= 6000
        assert spans[0][0] == 0
        assert spans[-1][1] == rollout.tokens - 1
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert rollout.routes.shape == (rollout.tokens - 1, *shape.row_shape)
        completion = np.zeros(rollout.tokens, bool)
        for prompt_len, completion_len in rollout.requests:
            completion[prompt_len : prompt_len + completion_len] = True
        assert np.array_equal(rollout.loss_mask, completion)
        assert (rollout.logprobs[completion] <= 0).all()
        assert not rollout.logprobs[~completion].any()


@pytest.mark.parametrize("kind", LENGTH_DISTRIBUTIONS)
def test_length_distributions_stay_in_range_with_the_longest_first(kind):
    lengths = draw_lengths(kind, 300, 4096, np.random.default_rng(0))
    assert lengths[0] == 4096 == lengths.max()
    assert lengths.min() >= 1
    assert lengths.dtype == np.int64
    if kind == "typical_rl":
        assert lengths.min() >= 4096 // 16


def test_an_unknown_length_distribution_is_refused():
    with pytest.raises(ConfigError, match="heavy_tail"):
        draw_lengths("bimodal", 3, 10, np.random.default_rng(0))


@pytest.mark.parametrize("kind", LENGTH_DISTRIBUTIONS)
def test_length_counts_are_checked_before_drawing(kind):
    """numpy's bare ValueErrors, and heavy_tail's lengths of 0 for max_len 0."""
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="max_len: expected an int >= 1, found 0"):
        draw_lengths(kind, 3, 0, rng)
    with pytest.raises(ConfigError, match="count: expected an int >= 0, found -1"):
        draw_lengths(kind, -1, 5, rng)


@pytest.mark.parametrize("producer", INLINE_PRODUCERS)
def test_each_producer_body_decodes_to_the_engine_rows(producer):
    shape = MODEL_SHAPES["kimi-k2"]
    (rollout,) = synth_rollouts(SyntheticRouter(shape, seed=4), 1, seed=4, max_turns=3)
    for j, (prompt_len, completion_len) in enumerate(rollout.requests):
        start, stop = rollout.route_span(j)
        (rows,) = source_rows(
            request_source(producer, rollout, j),
            prompt_len=prompt_len,
            completion_len=completion_len,
        )
        assert (rows.pos, rows.end) == (start, stop)
        assert np.array_equal(rows.array, rollout.routes[start:stop])
    zeroed = request_source(producer, rollout, 0, zero_routes=True)
    (engine_bug,) = source_rows(
        zeroed, prompt_len=rollout.requests[0][0], completion_len=rollout.requests[0][1]
    )  # decoded as sent: the loader's screen finds the all-zero rows missing
    assert engine_bug.rows == rollout.route_span(0)[1] - rollout.route_span(0)[0]
    assert not engine_bug.array.any()


def test_an_unknown_producer_is_refused():
    (rollout,) = synth_rollouts(SyntheticRouter(MODEL_SHAPES["qwen3-30b-a3b"]), 1, max_len=32)
    with pytest.raises(ConfigError, match="producer"):
        request_source("triton", rollout, 0)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_expert_load_counts_like_a_plain_loop(data):
    rows, layers, topk = (
        data.draw(st.integers(1, 30)),
        data.draw(st.integers(1, 5)),
        data.draw(st.integers(1, 4)),
    )
    experts = data.draw(st.integers(topk, 20))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    routes = rng.integers(0, experts, (rows, layers, topk)).astype(np.uint16)
    routes[:, 0] = 0  # a dense layer
    counts, counted = expert_load(routes, experts)
    expected_layers = [i for i in range(layers) if routes[:, i].any()]
    assert list(counted) == expected_layers
    for i, layer in enumerate(counted):
        for expert in range(experts):
            assert counts[i, expert] == int((routes[:, layer] == expert).sum())


def test_expert_load_refuses_ids_past_the_expert_count():
    with pytest.raises(WireFormatError, match=r"\[0, 4\)"):
        expert_load(np.full((2, 1, 2), 7, np.uint8), 4)


@settings(max_examples=25, deadline=None)
@given(max_len=st.integers(2, 40), max_turns=st.integers(1, 4), seed=st.integers(0, 99))
def test_no_rollout_is_longer_than_max_len(max_len, max_turns, seed):
    """With max_len 2 or 3 a first turn that did not fit was cut to a quarter-length prompt
    (at least 1) and a three-quarter completion rounded the other way: 3 or 4 tokens."""
    router = SyntheticRouter(ModelShape("test", 2, 4, 2))
    for rollout in synth_rollouts(router, 4, seed=seed, max_turns=max_turns, max_len=max_len):
        assert 2 <= rollout.tokens <= max_len
        assert sum(rollout.requests[-1]) == rollout.tokens


def test_a_negative_seed_is_a_config_error_naming_it():
    """numpy refuses a negative seed with a bare ValueError (a traceback from r3data demo)."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    with pytest.raises(ConfigError, match="seed: expected an int >= 0, found -1"):
        SyntheticRouter(shape, seed=-1)
    with pytest.raises(ConfigError, match="seed: expected an int >= 0, found -2"):
        synth_rollouts(SyntheticRouter(shape), 1, seed=-2)


def test_inline_route_bytes_count_every_row_a_format_without_a_prompt_start_resends():
    """Such a format sends every row from position 0 in each turn; only the new rows were
    counted, as if it were incremental."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    rollouts = synth_rollouts(SyntheticRouter(shape), 3, seed=3, max_turns=3, max_len=2048)
    assert any(len(r.requests) > 1 for r in rollouts)
    for producer, incremental in (("nemo-rl", False), ("vllm", True)):
        served = serve_rollouts(rollouts, producers=(producer,))
        spans = [(r, r.route_span(j)) for r in rollouts for j in range(len(r.requests))]
        sent = sum(
            r.routes[start if incremental else 0 : stop].nbytes for r, (start, stop) in spans
        )
        assert served.inline_route_bytes == sent
