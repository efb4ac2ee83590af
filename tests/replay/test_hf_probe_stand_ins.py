"""The router probe learns a contract from the router's code, never from its weights' values:
sharded (FSDP2 ``DTensor``) weights, on a one-process gloo world, and trained selection
biases give the contract of the unsharded model as built, and the module's own tensors are
back whatever ends the probe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import tiny_model

from r3data.replay.hf_routers import find_routers


@pytest.fixture(scope="module")
def gloo_world():
    """A one-process gloo world, so that ``fully_shard`` makes real DTensors."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
    from realparts import free_port

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def _contracts(model: torch.nn.Module) -> list[tuple]:
    return [
        (site.method, site.carries, site.selects_on_logits, site.probed)
        for site in find_routers(model).sites
    ]


def _sharded(family: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model, _ = tiny_model(family)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


# laguna: the router's selection bias is a parameter; afmoe: the block's `expert_bias`
# parameter is the router's second input; ernie: the bias is a [1, experts] parameter
@pytest.mark.parametrize("family", ["laguna", "afmoe", "ernie4_5_moe"])
def test_sharded_selection_bias_is_probed_as_the_unsharded_one(gloo_world, family):
    unsharded, _ = tiny_model(family)
    model = _sharded(family)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert any(type(t).__name__ == "DTensor" for t in tensors.values())
    contracts = _contracts(model)
    assert contracts == _contracts(unsharded)
    # sigmoid or softmax scores plus a bias select on probabilities, not raw logits
    assert [c[2] for c in contracts] == [False] * len(contracts)
    assert all(c[3] for c in contracts)  # probed before any forward
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert after.keys() == tensors.keys()
    assert all(after[name] is tensor for name, tensor in tensors.items())  # put back


@pytest.mark.parametrize("family", ["deepseek_v3", "laguna"])
def test_a_trained_negative_selection_bias_leaves_the_contract_as_built(family):
    built, _ = tiny_model(family)
    trained, _ = tiny_model(family)
    for name, tensor in list(trained.named_parameters()) + list(trained.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # as aux-loss-free balancing leaves it
            with torch.no_grad():
                tensor.copy_(torch.linspace(-0.5, 0.5, tensor.numel()).view(tensor.shape))
    assert _contracts(trained) == _contracts(built)
    assert not any(site.selects_on_logits for site in find_routers(trained).sites)


def test_a_probe_ended_by_a_base_exception_puts_the_sharded_weights_back(gloo_world):
    model = _sharded("qwen3_moe")
    router = model.model.layers[0].mlp.gate
    own = dict(router.named_parameters())
    assert own
    assert all(type(t).__name__ == "DTensor" for t in own.values())
    seen = {}

    def interrupted(*args, **kwargs):
        seen.update(router.named_parameters())
        raise KeyboardInterrupt

    router.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        find_routers(model)
    assert seen.keys() == own.keys()
    assert all(type(t).__name__ != "DTensor" for t in seen.values())  # stand-ins ran
    assert all(router._parameters[name] is t for name, t in own.items())


def test_a_router_holding_an_fsdp_module_of_its_own_is_checked_at_its_first_call(gloo_world):
    from hf_helpers import token_batch
    from torch.distributed.fsdp import fully_shard

    from r3data.replay import hf_inputs, record

    model, _ = tiny_model("afmoe")
    routers = [layer.mlp.router for layer in model.model.layers if hasattr(layer.mlp, "router")]
    assert routers
    for router in routers:
        fully_shard(router.gate)  # its Linear sharded apart: called through FSDP's hooks
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert not any(site.probed for site in find_routers(model).sites)
    inputs = hf_inputs(token_batch())
    with record(model, inputs) as recorded:
        model(**inputs)  # the probe left FSDP's lazy initialisation to the root's forward
    assert recorded.routes.values.shape[1:] == (len(routers), 2)
