"""Replay through torchtitan's own MoE layers (router, token dispatcher, grouped experts) on
the CPU: recorded routes through the wire and the loader reproduce the forward, activation
checkpointing changes no gradient, a drifted router still routes as replayed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hf_helpers import load, samples, token_batch

# torchtitan lives in its own folder (`make titan-env`: its pins would break .venv's fsspec)
TITAN = Path(__file__).resolve().parents[2] / ".cache" / "torchtitan"
if TITAN.is_dir() and str(TITAN) not in sys.path:
    sys.path.append(str(TITAN))
if importlib.util.find_spec("torchtitan") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from realparts import unavailable

    unavailable(f"torchtitan is not installed (make titan-env puts it in {TITAN})")

from torch.utils.checkpoint import checkpoint  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from r3data.errors import ReplayError  # noqa: E402
from r3data.replay import compare_routes, hf_inputs  # noqa: E402
from r3data.replay.torchtitan import find_routers, record, replay  # noqa: E402

DIM, EXPERTS, TOPK, VOCAB = 32, 8, 2, 96

# torchtitan's router asks for an fp32 CPU autocast, which torch declines with a warning
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def moe(score_func: str, route_norm: bool, groups: int | None) -> MoE:
    router = TokenChoiceTopKRouter.Config(
        num_experts=EXPERTS,
        gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
        top_k=TOPK,
        score_func=score_func,
        route_norm=route_norm,
        num_expert_groups=groups,
        num_limited_groups=1 if groups else None,
    )
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=16, num_experts=EXPERTS),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK),
    )
    return MoE.Config(num_experts=EXPERTS, routed_experts=experts, router=router).build()


class Block(torch.nn.Module):
    def __init__(self, layer: MoE) -> None:
        super().__init__()
        self.moe = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.moe(hidden)


class Decoder(torch.nn.Module):
    """Embedding, two MoE blocks (a softmax and a sigmoid, group-limited, router), head."""

    def __init__(self, groups: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(
            [Block(moe("softmax", True, None)), Block(moe("sigmoid", False, groups))]
        )
        self.head = torch.nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.normal_(0.0, 0.3)
        self.checkpointing = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.layers:
            if self.checkpointing:
                hidden = checkpoint(block, hidden, use_reentrant=False)
            else:
                hidden = block(hidden)
        return self.head(hidden)


def test_torchtitan_moe_layers_replay_recorded_routes_through_the_loader():
    model = Decoder()
    batch = token_batch()
    inputs = hf_inputs(batch)
    tokens = inputs["input_ids"]
    with torch.no_grad(), record(model, inputs) as recorded:
        expected = model(tokens)
    routes = recorded.routes
    assert routes.row_shape == (2, TOPK)

    loaded = load(samples(batch, routes, "inline"), last_token_row=True)
    with torch.no_grad(), replay(model, loaded, inputs) as session:
        got = model(tokens)
    mask = inputs.attention_mask.bool()
    assert torch.equal(got[mask], expected[mask])
    assert loaded.metadata["agreement"].mean_exact == 1.0 == session.agreement.mean_exact

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model.checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        with replay(model, loaded, inputs):
            model(tokens)[mask].sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, checkpointed = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))
    router = model.layers[0].moe.router.gate.weight
    assert router.grad is not None
    assert bool(router.grad.abs().sum() > 0)

    with torch.no_grad():
        for block in model.layers:
            block.moe.router.gate.weight.add_(torch.randn_like(block.moe.router.gate.weight))
        with record(model, inputs) as drifted:
            model(tokens)
        with replay(model, loaded, inputs) as session, record(model, inputs) as used:
            model(tokens)
        with replay(model, loaded, inputs, threshold=1.5) as strict:
            model(tokens)
    assert compare_routes(drifted.routes, routes).mean_exact < 1.0
    assert session.agreement.mean_exact < 1.0
    assert torch.equal(used.routes.values, routes.values)
    assert 0.0 < strict.agreement.replace_rate <= 1.0


def test_torchtitan_single_group_router_replays_its_routes():
    """One expert group and top-2: the group's top-2 over every expert runs first and looks
    like the pick; it passes through, and the pick itself is replayed (drifted router too)."""
    model = Decoder(groups=1)
    batch = token_batch()
    inputs = hf_inputs(batch)
    tokens = inputs["input_ids"]
    with torch.no_grad(), record(model, inputs) as recorded:
        expected = model(tokens)
    assert [site.passes for site in recorded.routers.sites] == [0, 1]
    loaded = load(samples(batch, recorded.routes, "inline"), last_token_row=True)
    mask = inputs.attention_mask.bool()
    with torch.no_grad():
        with replay(model, loaded, inputs):
            assert torch.equal(model(tokens)[mask], expected[mask])
        gate = model.layers[1].moe.router.gate.weight
        gate.add_(torch.randn_like(gate))
        with replay(model, loaded, inputs) as session, record(model, inputs) as used:
            model(tokens)
    assert torch.equal(used.routes.values, recorded.routes.values)
    assert session.agreement.mean_exact < 1.0


class MultiTokenDecoder(Decoder):
    """A decoder with a multi-token-prediction block after its layers (DeepSeek-V3's
    ``mtp_layers``): a router outside the decoder layers, which the engine sends no routes for."""

    def __init__(self) -> None:
        super().__init__()
        self.mtp_layers = torch.nn.ModuleList([Block(moe("softmax", True, None))])
        with torch.no_grad():  # torchtitan leaves its weights to init_weights
            for parameter in self.mtp_layers.parameters():
                parameter.normal_(0.0, 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in [*self.layers, *self.mtp_layers]:
            hidden = block(hidden)
        return self.head(hidden)


def test_torchtitan_multi_token_prediction_router_routes_by_its_own_pick():
    model = MultiTokenDecoder()
    routers = find_routers(model)
    assert [(s.layer, s.name) for s in routers.sites] == [
        (0, "layers.0.moe.router"),
        (1, "layers.1.moe.router"),
    ]
    batch = token_batch()
    inputs = hf_inputs(batch)
    tokens = inputs["input_ids"]
    with torch.no_grad(), record(model, inputs) as recorded:
        expected = model(tokens)
    assert recorded.routes.row_shape == (2, TOPK)
    loaded = load(samples(batch, recorded.routes, "inline"), last_token_row=True)
    mask = inputs.attention_mask.bool()
    with torch.no_grad(), replay(model, loaded, inputs), record(model, inputs) as used:
        got = model(tokens)
    assert torch.equal(used.routes.values, recorded.routes.values)
    assert torch.equal(got[mask], expected[mask])


def test_torchtitan_routes_that_do_not_fit_raise_before_the_forward():
    model = Decoder()
    inputs = hf_inputs(token_batch())
    with torch.no_grad(), record(model, inputs) as recorded:
        model(inputs["input_ids"])
    routes = recorded.routes
    ran = []
    model.register_forward_pre_hook(lambda *_: ran.append(1))
    top1 = type(routes)(routes.values[:, :, :1].contiguous(), routes.cu_seqlens)
    with (
        pytest.raises(ReplayError, match="top-2, the routes hold top-1"),
        replay(model, top1, inputs),
    ):
        model(inputs["input_ids"])
    assert not ran
    model.layers[1].moe.router._debug_force_load_balance = True
    with pytest.raises(ReplayError, match="forces load balancing"), record(model, inputs):
        pass


def test_torchtitan_forward_on_other_tokens_is_refused():
    """One replay context holds one micro-batch's routes: other tokens of the same shape (the
    next micro-batch) are refused; a forward on the same tokens replays them again."""
    model = Decoder()
    inputs = hf_inputs(token_batch(seed=0))
    with torch.no_grad(), record(model, inputs) as recorded:
        model(inputs["input_ids"])
    other = hf_inputs(token_batch(seed=1))["input_ids"]
    assert other.shape == inputs["input_ids"].shape
    with torch.no_grad(), replay(model, recorded.routes, inputs):
        model(inputs["input_ids"].clone())
        with pytest.raises(ReplayError, match="one replay context holds one micro-batch's"):
            model(other)
        with pytest.raises(ReplayError, match="one replay context holds one micro-batch's"):
            model(tokens=other)
