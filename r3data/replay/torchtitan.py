"""Record and replay routes in torchtitan's MoE layers, as :mod:`r3data.replay.hf` does.

torchtitan's ``TokenChoiceTopKRouter`` (0.3) scores ``[B, L, experts]`` with softmax or
sigmoid, adds the load-balancing ``expert_bias`` for the choice only, optionally limits the
choice to groups of experts, picks one ``torch.topk`` and gathers the unbiased scores at
the pick (then ``route_norm`` and ``route_scale``). The same top-k tap replays it: the
router's own code weights the replayed experts. Tokens are ``[B, L]`` batch-major, as
``hf_inputs(batch)["input_ids"]`` lays them out, one sample a row padded to the longest
(``pad_multiple`` rounds it up); torchtitan's own fixed-length rows packing several
documents are not that layout. torchtitan is never imported: routers are found
by class and attributes.

The router's ``_debug_force_load_balance`` replaces the pick after the top-k and is refused.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Literal

import torch

from r3data.batch import TensorBatch
from r3data.errors import ReplayError
from r3data.packed import PackedTensor
from r3data.replay.hf import model_device, replaying_model
from r3data.replay.hf_inputs import HFInputs
from r3data.replay.routing import FillOption, Record, Replay, Routers, recording
from r3data.replay.tap import RouterSite

__all__ = ["find_routers", "record", "replay"]

ROUTER_CLASS = "TokenChoiceTopKRouter"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def find_routers(model: torch.nn.Module) -> Routers:
    """One site per torchtitan router of a decoder layer, at the layer its module path names
    (``layers.<id>``: torchtitan's decoders keep their blocks there, keyed by layer id).

    Routers outside the decoder layers (DeepSeek-V3's multi-token-prediction block,
    ``mtp_layers.<i>``) route by their own top-k: the engine sends no routes for them. The
    layer count is the length of the model's ``layers``.
    """
    sites = []
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if type(module).__name__ != ROUTER_CLASS or match is None:
            continue
        if getattr(module, "_debug_force_load_balance", False):
            raise ReplayError(
                f"router {name} forces load balancing (_debug_force_load_balance): it replaces "
                "its pick after the top-k, so replayed experts would not be used"
            )
        layer = int(match.group(1))
        # scores are softmax or sigmoid probabilities: known from the class, checked per call
        site = RouterSite(layer, module, "forward", module.top_k, module.num_experts, name)
        single_group = module.top_k == 2 and getattr(module, "num_expert_groups", None) == 1
        sites.append(replace(site, probed=True, passes=int(single_group)))
    if not sites:
        raise ReplayError(
            f"{type(model).__name__} holds no torchtitan {ROUTER_CLASS} in its decoder layers "
            "(layers.<id>)"
        )
    sites.sort(key=lambda site: site.layer)
    layers = [site.layer for site in sites]
    if len(set(layers)) != len(layers):
        raise ReplayError(f"two routers share a decoder layer (layers {layers})")
    blocks = getattr(model, "layers", None)
    num_layers = len(blocks) if blocks is not None else len(sites)
    if layers[-1] >= num_layers:
        num_layers = layers[-1] + 1
    topks = {site.topk for site in sites}
    if len(topks) > 1:
        raise ReplayError(f"routers pick a different top-k per layer ({sorted(topks)})")
    return Routers(num_layers, tuple(sites))


@contextlib.contextmanager
def record(
    model: torch.nn.Module, inputs: HFInputs | None = None, *, fill: FillOption = "distinct"
) -> Iterator[Record]:
    """Capture the experts every router of ``model`` uses in one forward run inside."""
    with recording(find_routers(model), inputs, model_device(model), fill) as handle:
        yield handle


@contextlib.contextmanager
def replay(
    model: torch.nn.Module,
    routes: PackedTensor | TensorBatch,
    inputs: HFInputs,
    *,
    layer_axis: Literal["all", "moe"] | None = None,
    fill: FillOption = "distinct",
    threshold: float | None = None,
) -> Iterator[Replay]:
    """Route every token of ``inputs`` to ``routes``; arguments as :func:`r3data.replay.replay`.

    Run backward inside the context when activation checkpointing recomputes the routers.
    """
    with replaying_model(
        model,
        find_routers(model),
        routes,
        inputs,
        layer_axis=layer_axis,
        fill=fill,
        threshold=threshold,
        checkpointed=None,  # torchtitan's checkpoint wrapper is not visible from here
    ) as handle:
        yield handle
