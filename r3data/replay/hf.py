"""Record and replay routes in Hugging Face transformers MoE models.

::

    inputs = hf_inputs(batch)                       # input_ids, attention_mask, position_ids
    with replay(model, batch, inputs) as session:   # batch["routed_experts"], replayed
        loss = loss_fn(model(**inputs).logits)
        loss.backward()                             # recompute replays the same routes
    session.agreement                               # how far the trainer's own router drifted

Every router routes each token to the given experts; the routing weights come from the
router's own code on its own scores at those experts (softmax or sigmoid, ``norm_topk_prob``,
selection bias, routed scaling: whatever the family does), so gradients reach the router.
Routes are keyed by router module, so activation checkpointing's recompute of a layer
replays that layer's routes. Padding tokens get distinct experts (``fill``). A model whose
routers cannot be hooked, routes whose layer count or top-k do not match, ids out of range
or routes given to a dense layer raise :class:`~r3data.errors.ReplayError` before the
forward, and so do packed inputs (``hf_inputs(packed=True)``) for a model that would mix
their samples (:func:`check_packed`). :func:`record` captures the experts every router used,
as packed routes.

transformers is never imported here: routers are found from the model's own modules and
config (see :mod:`r3data.replay.hf_routers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from r3data.batch import TensorBatch
from r3data.errors import ReplayError
from r3data.packed import PackedTensor
from r3data.replay.hf_inputs import HFInputs
from r3data.replay.hf_packed import check_packed
from r3data.replay.hf_routers import find_routers
from r3data.replay.routing import FillOption, Record, Replay, Routers, recording, replaying

__all__ = ["ROUTES_FIELD", "VALID_FIELD", "check_packed", "record", "replay", "replaying_model"]

ROUTES_FIELD = "routed_experts"
VALID_FIELD = "routed_experts_valid"


@contextlib.contextmanager
def record(
    model: torch.nn.Module, inputs: HFInputs | None = None, *, fill: FillOption = "distinct"
) -> Iterator[Record]:
    """Capture the experts every MoE router of ``model`` uses in one forward run inside.

    With ``inputs``, padding tokens are routed to ``fill`` (as :func:`replay` would route
    them), so replaying the recorded routes reproduces this forward bit for bit; the
    routes come back packed (:attr:`Record.routes`). Packed ``inputs`` are refused for a
    model that would mix their samples (:func:`check_packed`).
    """
    if inputs is not None:
        check_packed(model, inputs)
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
    """Route every token of ``inputs`` to ``routes`` (see the module doc).

    ``routes``: packed ``[rows, layers, topk]`` of the inputs' samples, or a batch holding
    them as ``routed_experts`` (the agreement then counts only rows its
    ``routed_experts_valid`` marks, and lands in ``batch.metadata["agreement"]``).
    ``layer_axis``: ``"all"`` (one entry per decoder layer, dense ones zero, as vLLM
    reports) or ``"moe"`` (MoE layers only, as :func:`record` gives); by default the count
    decides. ``fill``: padding tokens' experts, ``"distinct"`` (``0..topk-1``),
    ``"round_robin"`` (spread over all experts) or explicit ids. ``threshold``: off by
    default; a ratio r keeps a replayed expert only when the trainer's own score for it is
    at least r times its weakest own top-k score, refilling from its own top-k (the replace
    rate is in the agreement). Packed ``inputs`` are refused for a model that would mix
    their samples (:func:`check_packed`).
    """
    check_packed(model, inputs)
    with replaying_model(
        model,
        find_routers(model),
        routes,
        inputs,
        layer_axis=layer_axis,
        fill=fill,
        threshold=threshold,
        checkpointed=lambda: _checkpointed(model),
    ) as handle:
        yield handle


@contextlib.contextmanager
def replaying_model(
    model: torch.nn.Module,
    routers: Routers,
    routes: PackedTensor | TensorBatch,
    inputs: HFInputs,
    *,
    layer_axis: Literal["all", "moe"] | None,
    fill: FillOption,
    threshold: float | None,
    checkpointed: Callable[[], bool] | None,
) -> Iterator[Replay]:
    """:func:`replay` on ``routers`` of ``model`` (transformers' or torchtitan's), forwards
    on these inputs only; on exit, ``checkpointed()`` (when the model's activation
    checkpointing can be seen) checks the recomputes, and a batch gets its agreement."""
    routes, batch = routes_of(routes)
    with (
        replaying(
            routers,
            routes,
            inputs,
            model_device(model),
            layer_axis=layer_axis,
            fill=fill,
            threshold=threshold,
            valid=None if batch is None else batch.get(VALID_FIELD),
        ) as handle,
        only_these_inputs(model, inputs),
    ):
        yield handle
    if checkpointed is not None:
        handle.session.check_recomputed(checkpointed())
    if batch is not None:
        batch.metadata["agreement"] = handle.agreement


@contextlib.contextmanager
def only_these_inputs(model: torch.nn.Module, inputs: HFInputs) -> Iterator[None]:
    """Refuse a forward on other token ids (``input_ids``, torchtitan's ``tokens``) than the
    routes were laid out for: another micro-batch of the same token count would otherwise
    take these routes, silently."""
    expected: dict[torch.device, torch.Tensor] = {}

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", kwargs.get("tokens", args[0] if args else None))
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
            return  # embeddings or a later pipeline stage's hidden states: the routers check
        want = expected.get(ids.device)
        if want is None:
            want = expected[ids.device] = inputs.input_ids.to(ids.device)
        if ids.shape != want.shape or not torch.equal(ids, want):
            found = (
                f"of shape {list(ids.shape)} other than the {list(want.shape)}"
                if ids.shape != want.shape
                else f"of shape {list(ids.shape)} holding other token ids than the ones"
            )
            raise ReplayError(
                f"the model was called with input_ids {found} the routes were laid out for: "
                "one replay context holds one micro-batch's routes (open one per micro-batch; "
                "inputs sharded over context-parallel ranks are not supported)"
            )

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def routes_of(routes: PackedTensor | TensorBatch) -> tuple[PackedTensor, TensorBatch | None]:
    """The routes, and the batch they came in (None for bare routes)."""
    if not isinstance(routes, TensorBatch):
        return routes, None
    if ROUTES_FIELD not in routes:
        raise ReplayError(f"the batch holds no {ROUTES_FIELD!r} field, found {list(routes)}")
    return routes[ROUTES_FIELD], routes


def model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _checkpointed(model: torch.nn.Module) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training
