"""Hugging Face replay beyond the family sweep: inputs and packed form, R2, agreement on a
drifted router, the score threshold, padding fill, and every way to get it wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from hf_helpers import TOPK, VOCAB, outputs, routers_of, tiny_model, token_batch

from r3data import PackedTensor, TensorBatch
from r3data.errors import ReplayError
from r3data.layout import RoundRobin
from r3data.replay import compare_routes, hf_inputs, record, replay
from r3data.replay.session import score_threshold


@pytest.fixture(scope="module")
def qwen():
    model, causal = tiny_model("qwen3_moe")
    return model.eval(), causal


def recorded(model, causal, inputs):
    with torch.no_grad(), record(model, inputs) as rec:
        out = outputs(model, causal, inputs)
    return rec.routes, out


# --- inputs ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    packed=st.booleans(),
    side=st.sampled_from(["left", "right"]),
    multiple=st.sampled_from([None, 4]),
)
def test_inputs_put_every_token_where_its_fields_and_routes_go(lengths, packed, side, multiple):
    batch = token_batch(lengths, seed=len(lengths))
    inputs = hf_inputs(
        batch, packed=packed, padding_side="right" if packed else side, pad_multiple=multiple
    )
    tokens = batch["token_ids"]
    ids = inputs["input_ids"].reshape(-1)
    real = inputs.token_mask()
    assert inputs["use_cache"] is False
    assert int(real.sum()) == sum(lengths)
    for b, segment in enumerate(tokens):
        rows = torch.from_numpy(np.flatnonzero(inputs.index == tokens.offsets[b]))
        assert rows.numel() == 1
        at = int(rows)
        assert torch.equal(ids[at : at + len(segment)], segment)  # contiguous, in order
        positions = inputs["position_ids"].reshape(-1)[at : at + len(segment)]
        assert positions.tolist() == list(range(len(segment)))
    if packed:
        assert "attention_mask" not in inputs
        assert inputs["input_ids"].shape[0] == 1
    else:
        assert torch.equal(inputs["attention_mask"].reshape(-1).bool(), real)
    assert torch.equal(inputs.pad(tokens, fill=-5).reshape(-1)[real], ids[real])
    assert bool((inputs.pad(tokens, fill=-5).reshape(-1)[~real] == -5).all())
    assert inputs.unpad(ids) == tokens


def test_inputs_refuse_what_is_not_token_ids():
    with pytest.raises(ReplayError, match="integer token ids"):
        hf_inputs(PackedTensor.from_lengths(torch.zeros(3), [3]))
    with pytest.raises(ReplayError, match=r"PackedTensor of token ids \[rows\], found \(2,\)"):
        hf_inputs(PackedTensor.from_lengths(torch.zeros(3, 2, dtype=torch.long), [3]))


def test_packed_inputs_route_as_the_padded_ones(qwen):
    model, causal = qwen
    batch = token_batch()
    padded = hf_inputs(batch)
    routes, expected = recorded(model, causal, padded)
    packed = hf_inputs(batch, packed=True)
    with torch.no_grad(), replay(model, routes, packed), record(model, packed) as used:
        got = outputs(model, causal, packed)
    assert torch.equal(used.routes.values, routes.values)
    mask = padded.attention_mask.bool()
    torch.testing.assert_close(got[0], expected[mask], rtol=0, atol=1e-5)


# --- R2 and agreement -------------------------------------------------------------------------


def test_r2_record_in_the_logprob_pass_replay_in_the_update(qwen):
    model, causal = qwen
    inputs = hf_inputs(token_batch(seed=3))
    with torch.no_grad(), record(model, inputs) as logprob_pass:  # the trainer's own routes
        old = torch.log_softmax(outputs(model, causal, inputs), -1)
    routes = logprob_pass.routes
    with replay(model, routes, inputs) as update, record(model, inputs) as used:
        new = torch.log_softmax(outputs(model, causal, inputs), -1)
    assert torch.equal(used.routes.values, routes.values)  # identical routing
    mask = inputs.attention_mask.bool()
    assert torch.equal(new[mask], old[mask])  # ratio exactly 1 on the first update
    assert update.agreement.mean_exact == 1.0
    assert update.agreement.mean_overlap == 1.0


def test_agreement_on_a_drifted_router_names_the_drifted_layer():
    model, causal = tiny_model("qwen3_moe", seed=1)
    model.eval()
    batch = token_batch(seed=4)
    inputs = hf_inputs(batch)
    routes, _ = recorded(model, causal, inputs)
    with torch.no_grad():
        gate = routers_of(model)[1]
        gate.weight.add_(torch.randn_like(gate.weight))
    drifted, _ = recorded(model, causal, inputs)
    offline = compare_routes(drifted, routes)
    batch["routed_experts"] = routes
    with torch.no_grad(), replay(model, batch, inputs) as session:
        outputs(model, causal, inputs)
    agreement = session.agreement
    assert batch.metadata["agreement"] == agreement
    assert agreement.layers == (0, 1)
    assert agreement.tokens == sum(batch["token_ids"].lengths)
    assert agreement.exact[0] == 1.0
    assert agreement.overlap[0] == 1.0
    assert agreement.exact[1] < 1.0
    assert agreement.exact[1] <= agreement.overlap[1] < 1.0
    assert agreement.worst(1) == [(1, agreement.exact[1])]
    # layer 1 sees the same hidden states replayed or not (layer 0 routes as recorded)
    assert agreement.exact[1] == offline.exact[1]
    assert agreement.overlap[1] == offline.overlap[1]
    assert agreement.as_dict()["worst_layers"][0] == 1
    assert agreement.replace_rate is None


# --- the score threshold ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 6),
    experts=st.integers(3, 8),
    topk=st.integers(1, 3),
    ratio=st.floats(0.05, 1.0),
    logits=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_score_threshold_keeps_well_scored_replayed_experts_and_refills_from_the_own_top_k(
    tokens, experts, topk, ratio, logits, seed
):
    topk = min(topk, experts)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(tokens, experts, generator=generator)
    scores = raw if logits else raw.softmax(-1)
    own = scores.topk(topk).indices
    replayed = torch.rand(tokens, experts, generator=generator).argsort(-1)[:, :topk]
    picked, replaced = score_threshold(scores, own, replayed, ratio, logits=logits)
    probs = raw.softmax(-1) if logits else scores
    for t in range(tokens):
        weakest = probs[t, own[t]].min()
        for slot in range(topk):
            keep = bool(probs[t, replayed[t, slot]] >= ratio * weakest)
            assert bool(replaced[t, slot]) is not keep
            if keep:
                assert picked[t, slot] == replayed[t, slot]
            else:
                assert int(picked[t, slot]) in own[t].tolist()
        assert len(set(picked[t].tolist())) == topk  # still distinct experts
        kept = {int(e) for e, r in zip(replayed[t], replaced[t], strict=True) if not r}
        fillers = [int(e) for e, r in zip(picked[t], replaced[t], strict=True) if r]
        best_first = [int(e) for e in own[t][probs[t, own[t]].argsort(descending=True)]]
        assert fillers == [e for e in best_first if e not in kept][: len(fillers)]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # probabilities; raw logits
def test_threshold_replace_rate_counts_the_slots_it_changed(family):
    model, causal = tiny_model(family, seed=2)
    model.eval()
    inputs = hf_inputs(token_batch(seed=5))
    routes, _ = recorded(model, causal, inputs)
    with torch.no_grad(), replay(model, routes, inputs, threshold=1.0) as own:
        outputs(model, causal, inputs)
    assert own.agreement.replace_rate == 0.0  # its own experts always pass
    generator = torch.Generator().manual_seed(0)
    experts = routers_of(model)[0].num_experts
    noise = torch.rand(routes.values.shape[0], routes.row_shape[0], experts, generator=generator)
    random = PackedTensor(noise.argsort(-1)[..., :TOPK].to(torch.uint8), routes.cu_seqlens)
    with (
        torch.no_grad(),
        replay(model, random, inputs, threshold=0.9) as session,
        record(model, inputs) as used,
    ):
        outputs(model, causal, inputs)
    agreement = session.agreement
    changed = (used.routes.values != random.values).float().mean(dim=(0, 2))
    assert 0.0 < agreement.replace_rate < 1.0
    assert agreement.replaced == pytest.approx(changed.tolist())


# --- padding fill -----------------------------------------------------------------------------


def test_round_robin_padding_spreads_over_experts_and_changes_no_real_token(qwen):
    model, causal = qwen
    inputs = hf_inputs(token_batch([2, 11, 3, 1]))
    routes, expected = recorded(model, causal, inputs)
    with torch.no_grad(), replay(model, routes, inputs, fill="round_robin") as session:
        got = outputs(model, causal, inputs)
    layers = session.routers.model_layers
    distinct = inputs.routes(routes, layers, layer_axis="moe", fill="distinct")
    spread = inputs.routes(routes, layers, layer_axis="moe", fill=RoundRobin(8))
    pads = ~inputs.token_mask()
    assert bool((distinct[0][pads] < TOPK).all())  # distinct: experts 0..k-1 only
    load = torch.bincount(spread[0][pads].reshape(-1).long(), minlength=8)
    assert int(load.min()) > 0  # every expert takes some padding, none takes it all
    assert int(load.max()) < int(torch.bincount(distinct[0][pads].reshape(-1).long()).max())
    mask = inputs.attention_mask.bool()
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fill", [[7, 8], [13, 108], np.array([0, 9]), RoundRobin(9)])
def test_an_explicit_fill_naming_experts_past_the_routers_is_refused_before_any_forward(qwen, fill):
    """Padding routed to expert 8 of 8 would fail inside the expert kernel, untyped (on a GPU,
    a device-side assert); the routes' own ids are checked, so are the fill's."""
    model, causal = qwen
    inputs = hf_inputs(token_batch([5, 3]))
    routes, _ = recorded(model, causal, inputs)
    refused = pytest.raises(ReplayError, match=r"fill: expected .*8 .*experts.*, found")
    with refused, torch.no_grad(), replay(model, routes, inputs, fill=fill):
        outputs(model, causal, inputs)
    for fine in ([6, 7], RoundRobin(8)):  # the last two experts; every expert
        with torch.no_grad(), replay(model, routes, inputs, fill=fine):
            outputs(model, causal, inputs)


# --- errors -----------------------------------------------------------------------------------


def test_routes_that_do_not_fit_raise_before_the_forward(qwen):
    model, causal = qwen
    batch = token_batch()
    inputs = hf_inputs(batch)
    routes, _ = recorded(model, causal, inputs)
    other = hf_inputs(token_batch([4, 4, 4]))
    big = routes.values.clone()
    big[0, 0, 0] = 8
    negative = routes.values.to(torch.int16)
    negative[1, 1, 1] = -1
    cases = [
        (routes, other, r"inputs' samples, lengths \[4, 4, 4\], found \[5, 9, 3\]"),
        (PackedTensor(big, routes.cu_seqlens), inputs, "expert id 8; .* from 8 experts"),
        (PackedTensor(negative, routes.cu_seqlens), inputs, "expert id -1"),
        (routes.values, inputs, "packed"),
        (TensorBatch({"token_ids": batch["token_ids"]}), inputs, "no 'routed_experts'"),
    ]
    ran = []
    hook = model.register_forward_pre_hook(lambda *_: ran.append(1))
    for bad_routes, bad_inputs, message in cases:
        with pytest.raises(ReplayError, match=message), replay(model, bad_routes, bad_inputs):
            outputs(model, causal, bad_inputs)
    with (
        pytest.raises(ReplayError, match="layer_axis must be 'all' or 'moe', found 'dense'"),
        replay(model, routes, inputs, layer_axis="dense"),
    ):
        pass
    with pytest.raises(ReplayError, match="hf_inputs"), replay(model, routes, dict(inputs)):
        pass
    with (
        pytest.raises(ReplayError, match="threshold must be a ratio > 0"),
        replay(model, routes, inputs, threshold=0.0),
    ):
        pass
    hook.remove()
    assert not ran
    with (
        pytest.raises(ReplayError, match=r"input_ids of shape \[3, 10\] other than the \[3, 9\]"),
        replay(model, routes, inputs),
    ):
        outputs(model, causal, hf_inputs(token_batch([10, 10, 10])))  # other inputs


def test_another_micro_batch_of_the_same_token_count_is_refused(qwen):
    """A replay context holds one micro-batch's routes: the next micro-batch, of the same
    lengths but other tokens, must not take them (the routers see only the token count)."""
    model, causal = qwen
    inputs = hf_inputs(token_batch(seed=0))
    routes, _ = recorded(model, causal, inputs)
    with replay(model, routes, inputs):
        outputs(model, causal, inputs)
        outputs(model, causal, hf_inputs(token_batch(seed=0)))  # the same ids, rebuilt
        with pytest.raises(ReplayError, match=r"holding other token ids than the ones the"):
            outputs(model, causal, hf_inputs(token_batch(seed=1)))
    plain = outputs(model, causal, hf_inputs(token_batch(seed=1)))  # the check left with it
    assert plain.shape[:2] == inputs.input_ids.shape


def test_dense_layers_take_zeros_or_placeholders_and_nothing_else():
    model, causal = tiny_model("deepseek_v3")  # layer 0 dense, layer 1 MoE
    model.eval()
    inputs = hf_inputs(token_batch())
    routes, expected = recorded(model, causal, inputs)
    vllm = torch.zeros(routes.values.shape[0], 2, TOPK, dtype=routes.dtype)  # every layer
    vllm[:, 1] = routes.values[:, 0]
    vllm[0, 0] = torch.arange(TOPK)  # r3data's placeholder where a row was missing
    all_layers = PackedTensor(vllm, routes.cu_seqlens)
    with torch.no_grad(), replay(model, all_layers, inputs):
        got = outputs(model, causal, inputs)
    mask = inputs.attention_mask.bool()
    assert torch.equal(got[mask], expected[mask])
    with (
        pytest.raises(ReplayError, match=r"layer_axis='moe' of this model .* expects 1"),
        replay(model, all_layers, inputs, layer_axis="moe"),
    ):
        pass
    vllm[3, 0] = torch.tensor([5, 1])
    with (
        pytest.raises(ReplayError, match=r"dense decoder layer 0 experts \[5, 1\] at row 3"),
        replay(model, PackedTensor(vllm, routes.cu_seqlens), inputs),
    ):
        pass


def test_backward_outside_the_context_under_checkpointing_is_an_error():
    model, causal = tiny_model("mixtral")
    model.train()
    model.activation_checkpointing_enable()
    inputs = hf_inputs(token_batch())
    routes, _ = recorded(model, causal, inputs)
    with (
        pytest.raises(ReplayError, match=r"call backward\(\) inside the context"),
        replay(model, routes, inputs),
    ):
        loss = outputs(model, causal, inputs).sum()
    del loss  # its backward would route by the trainer's own top-k: what the error says
    with replay(model, routes, inputs):
        outputs(model, causal, inputs).sum().backward()  # inside: fine


def test_contexts_leave_the_model_as_they_found_it(qwen):
    model, causal = qwen
    inputs = hf_inputs(token_batch())
    routes, _expected = recorded(model, causal, inputs)
    gates = routers_of(model)
    with pytest.raises(RuntimeError, match="boom"), replay(model, routes, inputs):
        raise RuntimeError("boom")
    assert all("forward" not in gate.__dict__ for gate in gates)
    with (
        replay(model, routes, inputs),
        pytest.raises(ReplayError, match="already replaying"),
        replay(model, routes, inputs),
    ):
        pass
    assert all("forward" not in gate.__dict__ for gate in gates)
    with torch.no_grad(), record(model, inputs) as twice:
        outputs(model, causal, inputs)
        outputs(model, causal, inputs)
    with pytest.raises(ReplayError, match="ran 2 forwards while recording"):
        twice.per_layer()
    with record(model) as bare:
        pass
    with pytest.raises(ReplayError, match="without inputs gives per_layer"):
        _ = bare.routes
    with pytest.raises(ReplayError, match="did not run while recording"):
        bare.per_layer()


def test_a_model_without_routers_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with (
        pytest.raises(ReplayError, match="found no list of 2 decoder layers holding MoE"),
        record(LlamaForCausalLM(config)),
    ):
        pass
    with pytest.raises(ReplayError, match="has no config"), record(torch.nn.Linear(2, 2)):
        pass


def test_a_router_that_rewrites_its_pick_is_refused_before_the_forward():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    class RewritingRouter(Qwen3MoeTopKRouter):  # as Zaya's router masks its skip expert
        def forward(self, hidden_states):
            logits, weights, indices = super().forward(hidden_states)
            return logits, weights, indices.clone()

    model, _ = tiny_model("qwen3_moe", seed=3)
    block = model.model.layers[1].mlp
    rewriting = RewritingRouter(model.config)
    rewriting.load_state_dict(block.gate.state_dict())
    block.gate = rewriting
    with (
        pytest.raises(ReplayError, match="does not return the experts its top-k picked"),
        record(model),
    ):
        pass
