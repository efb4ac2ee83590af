"""Find a Hugging Face MoE model's routers and learn each one's contract before any forward.

Structure: the decoder layers are the ``ModuleList`` of ``num_hidden_layers`` (text config)
that holds routers; a router is a module whose class name ends in ``Router``, ``Gate`` or
``Gating`` and that names a top-k (its own ``top_k``-like attribute, its block's or, for a
``...Router``, the config's). A layer without one is dense; a layer with two (JetMoE's
attention and MLP experts) is refused, since routes carry one entry per layer.

Contract: transformers' routers differ by family and by version (5.0 blocks picked the
top-k in ``route_tokens_to_experts`` from the router's logits; 5.2x routers return
``(logits, weights, indices)``; Llama4 returns dense scores). Rather than trust a family
name, each router is probed once on a few random hidden states under a
:class:`~r3data.replay.tap.TopkTap`: it must run exactly one top-k over its experts and
return the picked experts (or, Llama4, scores non-zero exactly there); a router that
returns only logits hands the probe to its block's ``route_tokens_to_experts``. Stand-ins of
the full shape take the place of the router's tensors while the probe runs, so the contract
depends on the code, not on the weights' values or their sharding (FSDP2 ``DTensor``). A
router the probe cannot run standalone (inputs it alone cannot supply, meta weights, a
module inside it sharded by FSDP2 on its own) is checked the same way at its first real
call instead.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from r3data.errors import ReplayError
from r3data.replay.routing import Routers
from r3data.replay.tap import RouterSite, TopkTap, carried, single_group_passes

__all__ = ["find_routers"]

_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_TOPK_NAMES = (
    "top_k",
    "num_experts_per_tok",
    "moe_topk",
    "moe_top_k",
    "top_k_experts",
    "num_experts_per_token",
)
_CHOICE_NAMES = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_PROBE_TOKENS = 16


@dataclass(frozen=True)
class _Contract:
    """What the probe learnt of one router module (holding no reference to it, so that the
    cache keyed by the module lets it go)."""

    on_block: bool
    """The pick is in the block's ``route_tokens_to_experts``, not the router's forward."""
    topk: int
    choices: int
    carries: str
    selects_on_logits: bool


_probed: weakref.WeakKeyDictionary[torch.nn.Module, _Contract | str] = weakref.WeakKeyDictionary()
_found: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Routers, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def find_routers(model: torch.nn.Module) -> Routers:
    """The model's routers with their contracts, or a :class:`ReplayError` saying why not.

    Found once per model and found again when a router module found before is no longer
    at its place in the model (replaced or wrapped since).
    """
    known = _found.get(model)
    if known is None or not _still_there(model, *known):
        known = _found[model] = _find(model)
    return known[0]


def _still_there(model: torch.nn.Module, routers: Routers, paths: tuple[str, ...]) -> bool:
    try:
        return all(
            model.get_submodule(path) is site.module
            for site, path in zip(routers.sites, paths, strict=True)
        )
    except AttributeError:
        return False


def _find(model: torch.nn.Module) -> tuple[Routers, tuple[str, ...]]:
    config = _text_config(model)
    layers = _decoder_layers(model, _int_attr(config, ("num_hidden_layers", "num_layers")))
    num_layers = len(layers)
    sites = []
    for index, layer in enumerate(layers):
        found = [
            (name, module, parent)
            for name, module, parent in _modules_with_parents(layer)
            if _is_router(module, parent)
        ]
        if len(found) > 1:
            names = ", ".join(f"{name} ({type(m).__name__})" for name, m, _ in found)
            raise ReplayError(
                f"decoder layer {index} has {len(found)} routers ({names}); routes carry one "
                "entry per layer, so this model cannot be replayed"
            )
        if found:
            name, module, parent = found[0]
            sites.append(_site(index, f"layers.{index}.{name}", module, parent, config))
    if not sites:
        raise ReplayError(
            f"{type(model).__name__} has no MoE router in its {num_layers} decoder layers "
            "(a dense model, or a router this package does not recognise)"
        )
    topks = {site.topk for site in sites}
    if len(topks) > 1:
        raise ReplayError(
            f"{type(model).__name__} routes a different top-k per layer ({sorted(topks)}); "
            "routes [tokens, layers, topk] need one"
        )
    paths = {id(module): path for path, module in model.named_modules()}
    return Routers(num_layers, tuple(sites)), tuple(paths[id(site.module)] for site in sites)


# --- structure ------------------------------------------------------------------------------


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ReplayError(f"{type(model).__name__} has no config: not a transformers model")
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _int_attr(owner: Any, names: Sequence[str]) -> int | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _decoder_layers(model: torch.nn.Module, num_layers: int | None) -> torch.nn.ModuleList:
    """The list of ``num_layers`` layers holding routers, else the one list that does
    (LongCat counts two sub-layers per layer in ``num_hidden_layers``)."""
    lists = [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        and any(_is_router(m, p) for layer in module for _, m, p in _modules_with_parents(layer))
    ]
    exact = [module for module in lists if len(module) == num_layers]
    if exact:
        return exact[0]
    outer = [m for m in lists if not any(m is not o and _contains(o, m) for o in lists)]
    if len(outer) == 1:
        return outer[0]
    raise ReplayError(
        f"{type(model).__name__}: found no list of {num_layers} decoder layers holding MoE "
        f"routers ({len(outer)} lists of other lengths hold some)"
    )


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


def _modules_with_parents(root: torch.nn.Module):
    for parent_name, parent in root.named_modules():
        for child_name, child in parent.named_children():
            yield (f"{parent_name}.{child_name}" if parent_name else child_name), child, parent


def _is_router(module: torch.nn.Module, parent: torch.nn.Module) -> bool:
    name = type(module).__name__
    if not _ROUTER_CLASS.search(name):
        return False
    return "Router" in name or _int_attr(module, _TOPK_NAMES) is not None


def _site(
    layer: int, name: str, module: torch.nn.Module, parent: torch.nn.Module, config: Any
) -> RouterSite:
    known = _probed.get(module)
    if isinstance(known, str):
        raise ReplayError(known)
    if known is not None:
        method = "route_tokens_to_experts" if known.on_block else "forward"
        return RouterSite(
            layer, parent if known.on_block else module, method, known.topk, known.choices,
            name, known.carries, known.selects_on_logits, probed=True,
        )  # fmt: skip
    topk = _int_attr(module, _TOPK_NAMES) or _int_attr(parent, _TOPK_NAMES)
    topk = topk or _int_attr(config, _TOPK_NAMES)
    choices = _int_attr(module, _CHOICE_NAMES) or _int_attr(parent, _CHOICE_NAMES)
    choices = choices or _int_attr(config, _CHOICE_NAMES) or _linear_rows(module)
    if topk is None or choices is None:
        reason = (
            f"router {name} ({type(module).__name__}) names no top-k and expert count "
            f"(found top_k={topk}, experts={choices})"
        )
        _probed[module] = reason
        raise ReplayError(reason)
    site = RouterSite(layer, module, "forward", topk, choices, name)
    try:
        hidden = _int_attr(config, ("hidden_size", "d_model"))
        site = _probe(site, parent, hidden, _int_attr(config, ("vocab_size",)))
    except ReplayError as error:
        _probed[module] = str(error)
        raise
    if site is not None:
        on_block = site.module is not module
        _probed[module] = _Contract(
            on_block, site.topk, site.choices, site.carries, site.selects_on_logits
        )
        return site
    return RouterSite(layer, module, "forward", topk, choices, name)


def _linear_rows(module: torch.nn.Module) -> int | None:
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    return linears[0].out_features if len(linears) == 1 else None


# --- the probe ------------------------------------------------------------------------------


def _probe(
    site: RouterSite, parent: torch.nn.Module, hidden: int | None, vocab: int | None
) -> RouterSite | None:
    """Run the router on random hidden states and learn its contract (None: cannot run it)."""
    weight = next((p for p in site.module.parameters() if p.is_floating_point()), None)
    if weight is None or hidden is None or weight.device.type == "meta":
        return None
    if _fsdp_inside(site.module):
        return None
    generator = torch.Generator().manual_seed(0)
    extra = _extra_inputs(site.module.forward, parent, vocab, generator)
    if extra is None:
        return None
    extra = tuple(_stand_in(tensor, generator).to(weight.device) for tensor in extra)
    states = torch.randn(_PROBE_TOKENS, hidden, generator=generator)
    states = states.to(weight.device, weight.dtype)
    tap, output = None, None
    with _stand_ins(site.module, generator):
        for shaped in (states, states.unsqueeze(0)):
            try:
                tap, output = _run(site.module.forward, (shaped, *extra), site, weight.device)
                break
            except ReplayError:
                raise
            except Exception:  # the router cannot run standalone on this shape
                continue
    if tap is None:
        return None
    if tap.calls == 0:
        return _probe_block(site, parent, output, weight.device)
    return _contract(site, tap, output)


@contextlib.contextmanager
def _stand_ins(module: torch.nn.Module, generator: torch.Generator) -> Iterator[None]:
    """While the probe runs, stand-ins take the place of the module's tensors (see
    :func:`_stand_in`), so that what it learns depends on the router's code alone: not on its
    weights' values (a trained or random selection bias can push probabilities below zero,
    which would pass them for raw logits), not on whether they are sharded (gathering FSDP2
    ``DTensor`` shards would be a collective on one rank's call), the same on every rank.
    The module's own tensors are back on exit, whatever ends the probe."""
    swapped = []
    shared: dict[int, torch.Tensor] = {}  # a tensor held twice gets one stand-in
    try:
        for owner in module.modules():
            for store in (owner._parameters, owner._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None:
                        continue
                    stand_in = shared.get(id(tensor))
                    if stand_in is None:
                        stand_in = _stand_in(tensor, generator)
                        if store is owner._parameters and stand_in is not tensor:
                            stand_in = torch.nn.Parameter(stand_in, requires_grad=False)
                        shared[id(tensor)] = stand_in
                    if stand_in is not tensor:
                        swapped.append((store, name, tensor))
                        store[name] = stand_in
        yield
    finally:
        for store, name, tensor in reversed(swapped):
            store[name] = tensor


def _stand_in(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A local tensor of ``tensor``'s full shape, device and dtype for the probe: ones for a
    vector (at most one dimension longer than 1: a bias, a per-expert or a norm scale, a
    temperature), as initialisers set them, so probabilities stay probabilities; random for a
    matrix (scaled as an initialiser would, so that scores neither vanish nor saturate).
    ``tensor`` itself if it holds no floating values (ids, masks), zeros if such a one is
    sharded."""
    floating = tensor.is_floating_point() or tensor.is_complex()
    if not floating and not _sharded(tensor):
        return tensor
    shape = tuple(tensor.shape)
    if not floating:
        values = torch.zeros(shape)
    elif sum(size > 1 for size in shape) <= 1:
        values = torch.ones(shape)
    else:
        values = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
    return values.to(tensor.device, tensor.dtype)


def _probe_block(
    site: RouterSite, parent: torch.nn.Module, logits: Any, device: torch.device
) -> RouterSite:
    """A router that returns only logits: its block picks in ``route_tokens_to_experts``."""
    method = getattr(parent, "route_tokens_to_experts", None)
    if not isinstance(logits, torch.Tensor) or logits.shape[-1] != site.choices or method is None:
        raise ReplayError(
            f"router {site.name} ({type(site.module).__name__}) picks its experts without a "
            f"top-k of k={site.topk} over its {site.choices} experts, so there is no pick to "
            "replace (its family needs its own handling)"
        )
    block = replace(site, module=parent, method="route_tokens_to_experts")
    tap, output = _run(method, (logits,), block, device)
    if tap.calls - single_group_passes(tap) != 1:
        raise ReplayError(
            f"{type(parent).__name__}.route_tokens_to_experts ran {tap.calls} top-k calls of "
            f"k={site.topk} over {site.choices} experts, expected exactly one"
        )
    return _contract(block, tap, output)


def _contract(site: RouterSite, tap: TopkTap, output: Any) -> RouterSite:
    passes = single_group_passes(tap)
    if tap.calls - passes != 1:
        raise ReplayError(
            f"router {site.name} ({type(site.module).__name__}) ran {tap.calls} top-k calls of "
            f"k={site.topk} over {site.choices} experts, expected exactly one"
        )
    # scores a softmax or sigmoid made are never negative; raw logits on random states are
    logits = bool((torch.isfinite(tap.scores) & (tap.scores < 0)).any())
    kind = carried(site, output, tap.used)
    return replace(site, carries=kind, selects_on_logits=logits, probed=True, passes=passes)


def _run(method: Any, args: tuple, site: RouterSite, device: torch.device) -> tuple[TopkTap, Any]:
    tap = TopkTap(site.topk, site.choices)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices), tap:
        output = method(*args)
    return tap, output


def _extra_inputs(
    forward: Any, parent: torch.nn.Module, vocab: int | None, generator: torch.Generator
) -> tuple | None:
    """Inputs after the hidden states: the block's tensors of the same name
    (``e_score_correction_bias``, ``expert_bias``, ...) or random ``input_ids`` (hash
    routers); None if a required one is missing."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    values = []
    for parameter in parameters[1:]:
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        value = getattr(parent, parameter.name, None)
        if parameter.name == "input_ids" and vocab is not None:
            value = torch.randint(0, vocab, (_PROBE_TOKENS,), generator=generator)
        if isinstance(value, torch.Tensor):
            values.append(value)
        elif parameter.default is inspect.Parameter.empty:
            return None
        else:
            break
    return tuple(values)


def _fsdp_inside(module: torch.nn.Module) -> bool:
    """Is a module inside the router an FSDP2 module of its own? The probe calls the router's
    ``forward`` (around its own hooks) but its children through theirs: such a child would
    gather its weights (a collective on one rank's call) and take itself for the root, which
    breaks the model's next forward."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(child, FSDPModule) for child in module.modules() if child is not module)


def _sharded(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"
