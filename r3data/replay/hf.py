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
forward. :func:`record` captures the experts every router used, as packed routes.

transformers is never imported here: routers are found from the model's own modules and
config (see :mod:`r3data.replay.hf_routers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch

from r3data.batch import TensorBatch
from r3data.errors import ReplayError
from r3data.layout import Fill, RoundRobin
from r3data.packed import PackedTensor
from r3data.replay.agreement import RoutingAgreement
from r3data.replay.hf_inputs import HFInputs
from r3data.replay.hf_routers import HFRouters, find_routers
from r3data.replay.session import RecordSession, ReplaySession
from r3data.replay.tap import tap_routers

__all__ = ["HFRecord", "HFReplay", "record", "replay"]

ROUTES_FIELD = "routed_experts"


class HFReplay:
    """An open replay: its routers and the routing agreement of its forwards so far."""

    def __init__(self, routers: HFRouters, session: ReplaySession) -> None:
        self.routers = routers
        self._session = session

    @property
    def agreement(self) -> RoutingAgreement:
        """Per layer: the trainer's own top-k against the replayed one (one synchronisation)."""
        return self._session.agreement


class HFRecord:
    """The experts every router used in the recorded forward."""

    def __init__(self, routers: HFRouters, session: RecordSession, inputs: HFInputs | None):
        self.routers = routers
        self._session = session
        self._inputs = inputs

    def per_layer(self) -> list[torch.Tensor]:
        """One ``[tokens, topk]`` int64 tensor per MoE layer, in the routers' token order."""
        return self._session.per_layer()

    @property
    def routes(self) -> PackedTensor:
        """``[rows, moe_layers, topk]`` per sample, the batch's packed form (padding left out),
        in the narrowest integer dtype holding the expert ids."""
        if self._inputs is None:
            raise ReplayError("record(model) without inputs gives per_layer() only")
        stacked = torch.stack(self.per_layer(), dim=1)
        choices = max(site.choices for site in self.routers.sites)
        dtype = torch.uint8 if choices <= 256 else torch.int16 if choices <= 32768 else torch.int32
        return self._inputs.unpad(stacked.to(dtype).cpu())


@contextlib.contextmanager
def record(
    model: torch.nn.Module,
    inputs: HFInputs | None = None,
    *,
    fill: Fill | Literal["round_robin"] = "distinct",
) -> Iterator[HFRecord]:
    """Capture the experts every MoE router of ``model`` uses in one forward run inside.

    With ``inputs``, padding tokens are routed to ``fill`` (as :func:`replay` would route
    them), so replaying the recorded routes reproduces this forward bit for bit; the
    routes come back packed (:attr:`HFRecord.routes`).
    """
    routers = find_routers(model)
    padding, real = None, None
    if inputs is not None:
        device = _device(model)
        fill = _fill(routers, fill)
        nothing = PackedTensor.from_lengths(
            torch.zeros(int(inputs.lengths.sum()), len(routers.sites), routers.topk,
                        dtype=torch.uint8),
            inputs.lengths,
        )  # fmt: skip
        rows = inputs.routes(nothing, routers.model_layers, layer_axis="moe", fill=fill)
        padding = {site.layer: t.to(device) for site, t in zip(routers.sites, rows, strict=True)}
        real = inputs.token_mask(device)
    session = RecordSession(routers.sites, padding, real)
    with tap_routers(routers.sites, session, replays=False):
        yield HFRecord(routers, session, inputs)


@contextlib.contextmanager
def replay(
    model: torch.nn.Module,
    routes: PackedTensor | TensorBatch,
    inputs: HFInputs,
    *,
    layer_axis: Literal["all", "moe"] | None = None,
    fill: Fill | Literal["round_robin"] = "distinct",
    threshold: float | None = None,
) -> Iterator[HFReplay]:
    """Route every token of ``inputs`` to ``routes`` (see the module doc).

    ``routes``: packed ``[rows, layers, topk]`` of the inputs' samples, or a batch holding
    them as ``routed_experts`` (the agreement then lands in ``batch.metadata["agreement"]``).
    ``layer_axis``: ``"all"`` (one entry per decoder layer, dense ones zero, as vLLM
    reports) or ``"moe"`` (MoE layers only, as :func:`record` gives); by default the count
    decides. ``fill``: padding tokens' experts, ``"distinct"`` (``0..topk-1``),
    ``"round_robin"`` (spread over all experts) or explicit ids. ``threshold``: off by
    default; a ratio r keeps a replayed expert only when the trainer's own score for it is
    at least r times its weakest own top-k score, refilling from its own top-k (the replace
    rate is in the agreement).
    """
    batch = routes if isinstance(routes, TensorBatch) else None
    if batch is not None:
        if ROUTES_FIELD not in batch:
            raise ReplayError(f"the batch holds no {ROUTES_FIELD!r} field, found {list(batch)}")
        routes = batch[ROUTES_FIELD]
    if not isinstance(inputs, HFInputs):
        raise ReplayError(f"inputs must come from hf_inputs(batch), found {type(inputs).__name__}")
    routers = find_routers(model)
    axis = _layer_axis(routers, routes, layer_axis)
    _check_ids(routers, routes, axis)
    if threshold is not None:
        unprobed = [s.name for s in routers.sites if not s.probed]
        if unprobed:
            raise ReplayError(
                f"threshold needs routers whose score kind was probed; {unprobed[0]} could not "
                "be probed before the forward"
            )
    fill = _fill(routers, fill)
    device = _device(model)
    per_layer = inputs.routes(routes, routers.model_layers, layer_axis=axis, fill=fill)
    session = ReplaySession(
        routers.sites,
        {site.layer: t.to(device) for site, t in zip(routers.sites, per_layer, strict=True)},
        inputs.token_mask(device),
        threshold=threshold,
    )
    with tap_routers(routers.sites, session, replays=True):
        yield HFReplay(routers, session)
    session.check_recomputed(_checkpointed(model))
    if batch is not None:
        batch.metadata["agreement"] = session.agreement


def _fill(routers: HFRouters, fill: Fill | Literal["round_robin"]) -> Fill:
    if isinstance(fill, str) and fill == "round_robin":
        return RoundRobin(min(site.choices for site in routers.sites))
    return fill


def _layer_axis(
    routers: HFRouters, routes: PackedTensor, layer_axis: str | None
) -> Literal["all", "moe"]:
    if not isinstance(routes, PackedTensor) or len(routes.row_shape) != 2:
        found = getattr(routes, "row_shape", type(routes).__name__)
        raise ReplayError(f"routes must be packed [rows, layers, topk], found rows {found}")
    layers, topk = routes.row_shape
    if topk != routers.topk:
        raise ReplayError(
            f"the model's routers pick top-{routers.topk}, the routes hold top-{topk} rows"
        )
    counts = {"all": routers.num_layers, "moe": len(routers.sites)}
    if layer_axis is not None:
        if layer_axis not in counts:
            raise ReplayError(f"layer_axis must be 'all' or 'moe', found {layer_axis!r}")
        if layers != counts[layer_axis]:
            raise ReplayError(
                f"routes hold {layers} layers; layer_axis={layer_axis!r} of this model "
                f"({counts['all']} layers, {counts['moe']} MoE) expects {counts[layer_axis]}"
            )
        return layer_axis  # type: ignore[return-value]
    for axis, count in counts.items():
        if layers == count:
            return axis  # type: ignore[return-value]
    raise ReplayError(
        f"routes hold {layers} layers; this model has {counts['all']} decoder layers, "
        f"{counts['moe']} of them MoE"
    )


def _check_ids(routers: HFRouters, routes: PackedTensor, axis: str) -> None:
    """Ids in range at MoE layers; dense layers hold no routes (zeros, or the distinct
    placeholder rows r3data writes where the engine sent none)."""
    values = routes.values
    if not values.numel():
        return
    moe = list(routers.moe_layers) if axis == "all" else list(range(len(routers.sites)))
    columns = values[:, moe].long()
    low, high = int(columns.min()), int(columns.max())
    choices = min(site.choices for site in routers.sites)
    if low < 0 or high >= choices:
        raise ReplayError(
            f"routes hold expert id {low if low < 0 else high}; this model's routers pick "
            f"from {choices} experts (ids 0..{choices - 1})"
        )
    if axis != "all":
        return
    dense = sorted(set(range(routers.num_layers)) - set(routers.moe_layers))
    if not dense:
        return
    block = values[:, dense].long()
    placeholder = torch.arange(routers.topk)
    given = block.ne(0).any(-1) & block.ne(placeholder).any(-1)
    if bool(given.any()):
        row, which = (int(i) for i in torch.nonzero(given)[0])
        raise ReplayError(
            f"routes give dense decoder layer {dense[which]} experts "
            f"{block[row, which].tolist()} at row {row}; a dense layer has no router (zeros "
            "expected): the routes come from another model"
        )


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _checkpointed(model: torch.nn.Module) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training
