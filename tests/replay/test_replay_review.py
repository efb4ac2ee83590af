"""Adversarial review of Hugging Face replay: the router picks exactly the replayed experts
for exactly the right token and layer, under every input layout; its gates are the trainer's
own scores at them; bad routes are refused typed before the forward; nothing outlives the
model."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from hf_helpers import TOPK, outputs, tiny_config, tiny_model, token_batch

from r3data import PackedTensor
from r3data.errors import ReplayError
from r3data.layout import PAD
from r3data.replay import compare_routes, hf_inputs, record, replay
from r3data.replay.hf_routers import find_routers

EXPERTS = 8


def build(model_type: str, seed: int = 0, **fields) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` with config ``fields`` set, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    return model.eval()


def random_routes(lengths, layers: int, seed: int = 0, dtype=torch.uint8) -> PackedTensor:
    """Distinct random experts per row: routes a trainer's router would rarely pick itself."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(int(sum(lengths)), layers, EXPERTS, generator=generator)
    return PackedTensor.from_lengths(noise.argsort(-1)[..., :TOPK].to(dtype), list(lengths))


def used_routes(model, routes, inputs, **options) -> PackedTensor:
    with torch.no_grad(), replay(model, routes, inputs, **options), record(model, inputs) as used:
        model(**inputs)
    return used.routes


@pytest.fixture(scope="module")
def qwen():
    model, _ = tiny_model("qwen3_moe")
    return model.eval()


# --- the right token, the right layer -----------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    packed=st.booleans(),
    side=st.sampled_from(["left", "right"]),
    multiple=st.sampled_from([None, 4]),
    fill=st.sampled_from(["distinct", "round_robin"]),
    seed=st.integers(0, 100),
)
def test_every_token_is_routed_to_its_own_replayed_experts(
    qwen, lengths, packed, side, multiple, fill, seed
):
    batch = token_batch(lengths, seed=seed)
    inputs = hf_inputs(
        batch, packed=packed, padding_side="right" if packed else side, pad_multiple=multiple
    )
    routes = random_routes(lengths, 2, seed=seed)
    with torch.no_grad(), replay(qwen, routes, inputs, fill=fill), record(qwen) as used:
        qwen(**inputs)
    per_layer = used.per_layer()  # [model tokens, topk] in the routers' order
    real = inputs.index != PAD
    for layer in range(2):
        got = per_layer[layer][torch.from_numpy(real)]
        want = routes.values[torch.from_numpy(inputs.index[real]).long(), layer]
        assert torch.equal(got, want.long())  # each model token: its own packed row
        pads = per_layer[layer][torch.from_numpy(~real)]
        assert bool((pads.sort(-1).values.diff(dim=-1) > 0).all())  # distinct at padding
        if fill == "distinct":
            assert bool((pads == torch.arange(TOPK)).all())


@pytest.mark.parametrize("axis", ["all", "moe"])
def test_moe_layers_between_dense_ones_take_their_own_column(axis):
    model = build("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 2])  # MoE: 1, 3
    assert find_routers(model).moe_layers == (1, 3)
    lengths = (4, 7)
    inputs = hf_inputs(token_batch(lengths))
    moe = random_routes(lengths, 2, seed=1)
    routes = moe
    if axis == "all":
        values = torch.zeros(moe.values.shape[0], 4, TOPK, dtype=moe.dtype)
        values[:, [1, 3]] = moe.values
        routes = PackedTensor(values, moe.cu_seqlens)
    assert torch.equal(used_routes(model, routes, inputs).values, moe.values)
    swapped = PackedTensor(moe.values.flip(1).contiguous(), moe.cu_seqlens)
    assert torch.equal(used_routes(model, swapped, inputs).values, swapped.values)


# --- the gates are the trainer's own scores at the replayed experts ------------------------


def test_group_limited_gates_are_the_unmasked_scores_at_replayed_experts():
    # DeepSeek-V2's group_limited_greedy takes its weights from the top-k of group-masked
    # scores: an expert outside the trainer's groups must still get its own score
    model = build("deepseek_v2", topk_method="group_limited_greedy")  # 2 groups, keep 1
    gate = model.model.layers[1].mlp.gate
    seen = {}
    gate.register_forward_hook(lambda module, args, out: seen.update(out=out))
    lengths = (5, 3)
    inputs = hf_inputs(token_batch(lengths))
    rows = torch.tensor([[0, 4]], dtype=torch.uint8).expand(8, -1)  # one expert per group
    routes = PackedTensor.from_lengths(rows.unsqueeze(1).contiguous(), list(lengths))
    with torch.no_grad(), replay(model, routes, inputs):
        model(**inputs)
    logits, weights, indices = seen["out"]
    assert indices[inputs.token_mask()].tolist() == [[0, 4]] * 8
    expected = logits.softmax(-1).gather(1, indices) * gate.routed_scaling_factor
    assert bool((weights > 0).all())
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)


# --- bad routes -----------------------------------------------------------------------------


def test_uint16_routes_replay(qwen):
    # vLLM sends uint16 above 256 experts, and the loader keeps the wire's dtype
    lengths = (5, 9, 3)
    inputs = hf_inputs(token_batch(lengths))
    routes = random_routes(lengths, 2, seed=2, dtype=torch.uint16)
    assert torch.equal(used_routes(qwen, routes, inputs).values, routes.values.to(torch.uint8))
    big = routes.values.clone()
    big[4, 1, 0] = 300
    with (
        pytest.raises(ReplayError, match=r"expert id 300; .* from 8 experts"),
        replay(qwen, PackedTensor(big, routes.cu_seqlens), inputs),
    ):
        pass


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.uint16, torch.int64])
def test_a_row_that_repeats_an_expert_is_refused_before_the_forward(qwen, dtype):
    # a router picks k distinct experts; [3, 3] would send the token to expert 3 twice
    lengths = (5, 9, 3)
    inputs = hf_inputs(token_batch(lengths))
    values = random_routes(lengths, 2, seed=3, dtype=dtype).values.clone()
    values[6, 1] = torch.tensor([3, 3])
    routes = PackedTensor.from_lengths(values, list(lengths))
    ran = []
    hook = qwen.register_forward_pre_hook(lambda *_: ran.append(1))
    with (
        pytest.raises(
            ReplayError,
            match=r"layer 1's router picks 2 distinct experts, .* give it \[3, 3\] at row 6",
        ),
        replay(qwen, routes, inputs),
    ):
        qwen(**inputs)
    hook.remove()
    assert not ran


def test_an_all_zero_moe_row_is_refused_and_dense_zeros_are_not():
    model = build("deepseek_v3")  # layer 0 dense, layer 1 MoE
    lengths = (4, 6)
    inputs = hf_inputs(token_batch(lengths))
    moe = random_routes(lengths, 1, seed=4)
    values = torch.zeros(10, 2, TOPK, dtype=torch.uint8)
    values[:, 1] = moe.values[:, 0]
    routes = PackedTensor.from_lengths(values, list(lengths))
    assert torch.equal(used_routes(model, routes, inputs).values, moe.values)
    values[7, 1] = 0  # an engine's all-zero row at an MoE layer: no route, not experts 0, 0
    with (
        pytest.raises(ReplayError, match=r"give it \[0, 0\] at row 7"),
        replay(model, PackedTensor.from_lengths(values, list(lengths)), inputs),
    ):
        pass


# --- the model's routers are its current ones ------------------------------------------------


def test_a_router_replaced_after_a_replay_is_the_one_replayed():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    model, _ = tiny_model("qwen3_moe", seed=5)
    model.eval()
    lengths = (5, 9, 3)
    inputs = hf_inputs(token_batch(lengths))
    routes = random_routes(lengths, 2, seed=5)
    assert torch.equal(used_routes(model, routes, inputs).values, routes.values)
    block = model.model.layers[1].mlp
    fresh = Qwen3MoeTopKRouter(model.config)
    fresh.load_state_dict(block.gate.state_dict())
    block.gate = fresh  # e.g. a wrapper or a reload after the first step
    with torch.no_grad(), replay(model, routes, inputs) as session:
        model(**inputs)
    assert session.agreement.tokens == sum(lengths)
    assert session.routers.sites[1].module is fresh
    assert torch.equal(used_routes(model, routes, inputs).values, routes.values)


@pytest.mark.parametrize("family", ["qwen3_moe", "dbrx"])  # a router; a block's method
def test_finding_routers_keeps_no_module_alive(family):
    model, causal = tiny_model(family)
    inputs = hf_inputs(token_batch())
    with torch.no_grad(), record(model, inputs):
        outputs(model, causal, inputs)
    sites = [weakref.ref(site.module) for site in find_routers(model).sites]
    del model
    gc.collect()
    assert [site() for site in sites] == [None, None]


# --- lifecycle ------------------------------------------------------------------------------


def test_an_error_inside_the_forward_leaves_no_tap_behind(qwen):
    lengths = (5, 9, 3)
    inputs = hf_inputs(token_batch(lengths))
    routes = random_routes(lengths, 2, seed=6)
    gates = [site.module for site in find_routers(qwen).sites]

    def fail(*_):
        raise KeyError("inside")

    hook = qwen.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(KeyError, match="inside"), replay(qwen, routes, inputs):
        qwen(**inputs)
    hook.remove()
    assert all("forward" not in vars(gate) for gate in gates)
    assert torch.equal(used_routes(qwen, routes, inputs).values, routes.values)


def test_train_mode_and_a_second_forward_replay_the_same_routes():
    model, _ = tiny_model("mixtral", seed=7)
    model.train()
    lengths = (6, 2)
    inputs = hf_inputs(token_batch(lengths))
    routes = random_routes(lengths, 2, seed=7)
    with replay(model, routes, inputs) as session:
        with record(model, inputs) as first:
            model(**inputs)
        with record(model, inputs) as second:
            model(**inputs).logits.sum().backward()
    assert session.session.forwards == {0: 2, 1: 2}
    assert session.session.recomputes == {0: 0, 1: 0}
    assert torch.equal(first.routes.values, routes.values)
    assert torch.equal(second.routes.values, routes.values)


# --- agreement by hand ----------------------------------------------------------------------


def test_agreement_numbers_by_hand():
    own = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 5]]])
    replayed = torch.tensor([[[1, 0], [2, 4]], [[4, 6], [6, 7]], [[1, 0], [0, 1]]])
    result = compare_routes(
        PackedTensor.from_lengths(own, [2, 1]),
        PackedTensor.from_lengths(replayed, [2, 1]),
        layers=(3, 5),
    )
    # layer 3: sets equal at tokens 0 and 2, token 1 shares one of two experts
    # layer 5: token 1 equal; token 0 shares 2 of {2, 4}; token 2 shares none of {0, 1}
    assert result.layers == (3, 5)
    assert result.tokens == 3
    assert result.exact == pytest.approx((2 / 3, 1 / 3))
    assert result.overlap == pytest.approx((5 / 6, 3 / 6))
    assert result.worst(1) == [(5, pytest.approx(1 / 3))]
    assert result.replace_rate is None


def test_placeholder_rows_are_replayed_but_not_counted(qwen):
    from r3data import TensorBatch

    lengths = (5, 9, 3)
    batch = token_batch(lengths)
    inputs = hf_inputs(batch)
    routes = random_routes(lengths, 2, seed=8)
    valid = np.ones(sum(lengths), dtype=bool)
    valid[[4, 13, 16]] = False  # every sample's last row
    batch = TensorBatch(
        {
            "token_ids": batch["token_ids"],
            "routed_experts": routes,
            "routed_experts_valid": PackedTensor.from_lengths(torch.from_numpy(valid), lengths),
        }
    )
    with torch.no_grad(), replay(qwen, batch, inputs) as session, record(qwen, inputs) as used:
        qwen(**inputs)
    assert torch.equal(used.routes.values, routes.values)  # placeholders replayed too
    assert session.agreement.tokens == sum(lengths) - 3
    with torch.no_grad(), record(qwen, inputs) as own:
        qwen(**inputs)
    keep = torch.from_numpy(valid)
    expected = compare_routes(
        PackedTensor.from_lengths(own.routes.values[keep], [4, 8, 2]),
        PackedTensor.from_lengths(routes.values[keep], [4, 8, 2]),
    )
    # layer 0 sees the same hidden states replayed or not (layer 1 sees layer 0's replay)
    assert session.agreement.exact[0] == pytest.approx(expected.exact[0])
    assert session.agreement.overlap[0] == pytest.approx(expected.overlap[0])
    assert expected.exact[0] < 1.0


def test_round_robin_padding_matches_the_hand_rule(qwen):
    lengths = (1, 4)
    inputs = hf_inputs(token_batch(lengths))  # [2, 4]: sample 0 padded at places 1, 2, 3
    routes = random_routes(lengths, 2, seed=9)
    with torch.no_grad(), replay(qwen, routes, inputs, fill="round_robin"), record(qwen) as used:
        qwen(**inputs)
    layout = find_routers(qwen).model_layers
    assert layout.moe_layer_ids == (0, 1)
    pads = used.per_layer()[0][torch.from_numpy(inputs.index == PAD)]
    # place p of the padded batch gets (p * topk + arange(topk)) % experts
    places = torch.tensor([1, 2, 3])
    expected = (places[:, None] * TOPK + torch.arange(TOPK)) % EXPERTS
    assert torch.equal(pads, expected)
