"""Record and replay under ``torch.compile``: the router's forward runs eagerly (a graph break),
so a compiled model replays as the eager one does and routes by its own pick again after the
context; ``fullgraph=True`` is refused by torch with r3data's reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import load, outputs, routers_of, samples, tiny_model, token_batch

from r3data.replay import hf_inputs, record, replay


def compiled_blocks(model: torch.nn.Module, *, fullgraph: bool) -> None:
    blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for block in blocks:
        block.compile(backend="eager", fullgraph=fullgraph)


def recorded_model():
    """A tiny Qwen3-MoE, its inputs, what it recorded and those routes through the loader."""
    torch._dynamo.reset()
    model, causal = tiny_model("qwen3_moe")
    batch = token_batch()
    inputs = hf_inputs(batch)
    with torch.no_grad(), record(model, inputs) as recorded:
        outputs(model, causal, inputs)
    routes = load(samples(batch, recorded.routes, "inline"), last_token_row=True)
    return model, causal, inputs, recorded, routes


def test_compiled_model_replays_as_the_eager_one():
    model, causal, inputs, recorded, routes = recorded_model()
    with torch.no_grad():
        for router in routers_of(model):
            for parameter in router.parameters():
                parameter.add_(torch.randn_like(parameter))
        eager_own = outputs(model, causal, inputs)
        with replay(model, routes, inputs):
            eager_replayed = outputs(model, causal, inputs)
        compiled_blocks(model, fullgraph=False)
        with replay(model, routes, inputs) as session, record(model, inputs) as used:
            compiled_replayed = outputs(model, causal, inputs)
        compiled_own = outputs(model, causal, inputs)
    assert torch.equal(used.routes.values, recorded.routes.values)
    assert session.agreement.mean_exact < 1.0
    torch.testing.assert_close(compiled_replayed, eager_replayed)
    torch.testing.assert_close(compiled_own, eager_own)  # no replayed graph left behind
    assert not torch.allclose(compiled_own, compiled_replayed)


def test_fullgraph_compile_is_refused_with_the_reason():
    model, causal, inputs, _, routes = recorded_model()
    compiled_blocks(model, fullgraph=True)
    with (
        pytest.raises(
            torch._dynamo.exc.Unsupported, match="compile the model's blocks with fullgraph=False"
        ),
        torch.no_grad(),
        replay(model, routes, inputs),
    ):
        outputs(model, causal, inputs)
