"""Every transformers MoE family with a replayable router, on a tiny random model:
recorded routes -> wire envelope -> ``r3data.loader`` -> ``replay`` reproduce the recorded
forward; gradient checkpointing changes no gradient; a drifted router agrees below 100%
while the replayed forward routes 100% as recorded; mismatched routes raise before the
forward. Families refused are refused before the forward, saying why.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import (
    FAMILIES,
    REFUSED,
    load,
    outputs,
    routers_of,
    samples,
    tiny_model,
    token_batch,
)

from r3data import PackedTensor
from r3data.errors import ReplayError
from r3data.replay import compare_routes, hf_inputs, record, replay

#: fp32 tolerance where the last token's route is a placeholder: that token then meets
#: other tokens in different experts, whose matrix products may round differently.
PLACEHOLDER_ATOL = 1e-5


def real_positions(inputs, drop_last: bool) -> torch.Tensor:
    """``[B, S]`` bool: real tokens (without each sample's last one when ``drop_last``)."""
    mask = inputs.attention_mask.bool()
    if drop_last:
        last = mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)
        mask = mask & ~last
    return mask


def gradients(model, causal, batch, inputs, *, checkpointing: bool) -> dict[str, torch.Tensor]:
    if checkpointing:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    with replay(model, batch, inputs):
        out = outputs(model, causal, inputs)
        weights = torch.linspace(-1, 1, out.shape[-1])
        (out[inputs.attention_mask.bool()] * weights).sum().backward()
    model.activation_checkpointing_disable()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_checkpointing(model, causal, batch, inputs) -> None:
    plain = gradients(model, causal, batch, inputs, checkpointing=False)
    checkpointed = gradients(model, causal, batch, inputs, checkpointing=True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert torch.equal(grad, checkpointed[name]), name
    router_params = {id(p) for r in routers_of(model) for p in r.parameters()}
    router_grads = [p.grad for p in model.parameters() if id(p) in router_params]
    assert any(g is not None and g.abs().sum() > 0 for g in router_grads), "no router gradient"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_replays_its_recorded_routes(family):
    model, causal = tiny_model(family)
    model.train()  # gradient checkpointing is only active in training mode
    batch = token_batch()
    inputs = hf_inputs(batch)
    with torch.no_grad(), record(model, inputs) as recorded:
        expected = outputs(model, causal, inputs)
    routes = recorded.routes
    assert routes.row_shape == (len(recorded.routers.sites), recorded.routers.topk)

    # through the wire and the loader: every row known -> bit for bit
    inline = load(samples(batch, routes, "inline"), last_token_row=True)
    assert torch.equal(inline["routed_experts"].values, routes.values)
    inputs = hf_inputs(inline)
    with torch.no_grad(), replay(model, inline, inputs):
        got = outputs(model, causal, inputs)
    mask = real_positions(inputs, drop_last=False)
    assert torch.equal(got[mask], expected[mask])

    # prime-rl envelope: the last token's row is a placeholder -> tolerance, last not compared
    primerl = load(samples(batch, routes, "prime-rl"))
    assert not primerl["routed_experts_valid"].values.all()
    with torch.no_grad(), replay(model, primerl, inputs):
        got = outputs(model, causal, inputs)
    mask = real_positions(inputs, drop_last=True)
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=PLACEHOLDER_ATOL)

    # activation checkpointing recomputes every layer in backward: same routes, same grads
    check_checkpointing(model, causal, inline, inputs)

    # a drifted router disagrees with the routes, and replay still routes exactly by them
    with torch.no_grad():
        for router in routers_of(model):
            for parameter in router.parameters():
                parameter.add_(torch.randn_like(parameter))
        with record(model, inputs) as drifted:
            outputs(model, causal, inputs)
        assert compare_routes(drifted.routes, inline["routed_experts"]).mean_exact < 1.0
        with replay(model, inline, inputs) as session, record(model, inputs) as used:
            outputs(model, causal, inputs)
    assert torch.equal(used.routes.values, routes.values)
    assert session.agreement.mean_exact < 1.0

    # routes that do not fit raise before any module runs
    ran = []
    hook = model.register_forward_pre_hook(lambda *_: ran.append(1))
    wrong = [
        PackedTensor(routes.values[:, :, :1].contiguous(), routes.cu_seqlens),  # top-1
        PackedTensor(routes.values.repeat(1, 3, 1), routes.cu_seqlens),  # 3x the layers
    ]
    for bad in wrong:
        with pytest.raises(ReplayError, match=r"top-|layers"), replay(model, bad, inputs):
            outputs(model, causal, inputs)
    hook.remove()
    assert not ran


def single_group_families() -> list[str]:
    """Families whose group-limited choice takes each group's top-2 before the pick."""
    from hf_helpers import tiny_config

    return [
        family
        for family in sorted(FAMILIES)
        if hasattr(config := tiny_config(FAMILIES[family][0]), "n_group")
        and getattr(config, "topk_method", "noaux_tc") != "greedy"
    ]


@pytest.mark.parametrize("family", single_group_families())
def test_single_group_router_replays_its_routes(family):
    """With ``n_group=1`` and top-2 the group's top-2 over every expert runs before the
    router's own top-2 and looks like it: it passes through untouched, the pick is replayed."""
    model, causal = tiny_model(family, n_group=1, topk_group=1)
    batch = token_batch()
    inputs = hf_inputs(batch)
    with torch.no_grad(), record(model, inputs) as recorded:
        expected = outputs(model, causal, inputs)
    assert all(site.passes == 1 for site in recorded.routers.sites)
    inline = load(samples(batch, recorded.routes, "inline"), last_token_row=True)
    with torch.no_grad():
        for router in routers_of(model):
            for parameter in router.parameters():
                parameter.add_(torch.randn_like(parameter))
        with replay(model, inline, inputs) as session, record(model, inputs) as used:
            got = outputs(model, causal, inputs)
    assert torch.equal(used.routes.values, recorded.routes.values)
    assert session.agreement.mean_exact < 1.0
    assert got.shape == expected.shape


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_without_a_replayable_router_is_refused_before_the_forward(family):
    model, causal = tiny_model(family)
    inputs = hf_inputs(token_batch())
    ran = []
    model.register_forward_pre_hook(lambda *_: ran.append(1))
    with pytest.raises(ReplayError, match=REFUSED[family]), record(model, inputs):
        outputs(model, causal, inputs)
    assert not ran
