"""Record and replay over a model's routers, whoever found them (Hugging Face, torchtitan).

A :class:`Routers` lists one :class:`~r3data.replay.tap.RouterSite` per MoE layer.
:func:`replaying` checks packed routes against it before any forward (top-k, layer count
and axis, expert ids, nothing given to dense layers), lays them out as the inputs are laid
out and opens a :class:`~r3data.replay.session.ReplaySession` on every site;
:func:`recording` opens a :class:`~r3data.replay.session.RecordSession`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from r3data.errors import ReplayError
from r3data.layout import PAD, Fill, ModelLayers, RoundRobin
from r3data.packed import PackedTensor
from r3data.replay.agreement import RoutingAgreement
from r3data.replay.hf_inputs import HFInputs
from r3data.replay.session import RecordSession, ReplaySession
from r3data.replay.tap import RouterSite, tap_routers

__all__ = ["Record", "Replay", "Routers", "recording", "replaying"]

FillOption = Fill | Literal["round_robin"]
#: Route dtypes without a CPU min or max in torch: widened for the id check.
_WIDENED = (torch.uint16, torch.uint32)


@dataclass(frozen=True)
class Routers:
    """The routers of one model: one :class:`RouterSite` per MoE layer, in layer order."""

    num_layers: int
    sites: tuple[RouterSite, ...]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(site.layer for site in self.sites)

    @property
    def topk(self) -> int:
        return self.sites[0].topk

    @property
    def choices(self) -> int:
        """Experts every router can pick from (the fewest, where they differ)."""
        return min(site.choices for site in self.sites)

    @property
    def model_layers(self) -> ModelLayers:
        moe = set(self.moe_layers)
        return ModelLayers(self.num_layers, tuple(int(i in moe) for i in range(self.num_layers)))


class Replay:
    """An open replay: its routers and the routing agreement of its forwards so far."""

    def __init__(self, routers: Routers, session: ReplaySession) -> None:
        self.routers = routers
        self.session = session

    @property
    def agreement(self) -> RoutingAgreement:
        """Per layer: the trainer's own top-k against the replayed one (one synchronisation)."""
        return self.session.agreement


class Record:
    """The experts every router used in the recorded forward."""

    def __init__(self, routers: Routers, session: RecordSession, inputs: HFInputs | None):
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
def recording(
    routers: Routers, inputs: HFInputs | None, device: torch.device, fill: FillOption
) -> Iterator[Record]:
    """Record every router; with ``inputs``, padding tokens are pinned to ``fill``."""
    padding, real = None, None
    if inputs is not None:
        _check_inputs(inputs)
        rows, layers = int(inputs.lengths.sum()), len(routers.sites)
        nothing = PackedTensor.from_lengths(
            torch.zeros(rows, layers, routers.topk, dtype=torch.uint8), inputs.lengths
        )
        per_layer = inputs.routes(
            nothing, routers.model_layers, layer_axis="moe", fill=resolve_fill(routers, fill)
        )
        padding = _on_device(routers, per_layer, device)
        real = inputs.token_mask(device)
    session = RecordSession(routers.sites, padding, real)
    with tap_routers(routers.sites, session, replays=False):
        yield Record(routers, session, inputs)


@contextlib.contextmanager
def replaying(
    routers: Routers,
    routes: PackedTensor,
    inputs: HFInputs,
    device: torch.device,
    *,
    layer_axis: Literal["all", "moe"] | None,
    fill: FillOption,
    threshold: float | None,
    valid: PackedTensor | None = None,
) -> Iterator[Replay]:
    """Replay ``routes`` on every router (checked, then laid out as ``inputs``).

    ``valid`` (per token, False where the routes hold a placeholder) keeps placeholder rows
    out of the agreement: they say nothing about drift.
    """
    _check_inputs(inputs)
    axis = check_routes(routers, routes, layer_axis)
    if threshold is not None:
        unprobed = [s.name for s in routers.sites if not s.probed]
        if unprobed:
            raise ReplayError(
                f"threshold needs routers whose score kind was probed; {unprobed[0]} could not "
                "be probed before the forward"
            )
    per_layer = inputs.routes(
        routes, routers.model_layers, layer_axis=axis, fill=resolve_fill(routers, fill)
    )
    on_device = _on_device(routers, per_layer, device)
    _check_distinct(routers, on_device, inputs)
    counted = inputs.token_mask(device)
    if valid is not None:
        counted &= inputs.pad(valid.to(dtype=torch.bool), fill=False).reshape(-1).to(device)
    session = ReplaySession(routers.sites, on_device, counted, threshold=threshold)
    with tap_routers(routers.sites, session, replays=True):
        yield Replay(routers, session)


def resolve_fill(routers: Routers, fill: FillOption) -> Fill:
    """``fill`` for these routers; explicit ids are checked against their experts (the layout
    checks the row's shape and distinctness), since an id past them fails inside the expert
    kernel, untyped (on a GPU, a device-side assert)."""
    if isinstance(fill, str) and fill == "round_robin":
        return RoundRobin(routers.choices)
    if isinstance(fill, RoundRobin) and fill.num_experts > routers.choices:
        raise ReplayError(
            f"fill: expected RoundRobin over at most {routers.choices} experts (the routers'), "
            f"found RoundRobin({fill.num_experts})"
        )
    if isinstance(fill, str | RoundRobin):
        return fill
    try:
        ids = torch.as_tensor(fill)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return fill  # the layout names what a fill must be
    if ids.numel() and not ids.dtype.is_floating_point and int(ids.max()) >= routers.choices:
        raise ReplayError(
            f"fill: expected expert ids below {routers.choices} (the routers' experts), found "
            f"{int(ids.max())} in {ids.tolist()}"
        )
    return fill


def check_routes(
    routers: Routers, routes: PackedTensor, layer_axis: str | None
) -> Literal["all", "moe"]:
    """The routes' layer axis, after checking shape, top-k, ids and dense layers."""
    if not isinstance(routes, PackedTensor) or len(routes.row_shape) != 2:
        found = getattr(routes, "row_shape", type(routes).__name__)
        raise ReplayError(f"routes must be packed [rows, layers, topk], found rows {found}")
    layers, topk = routes.row_shape
    if topk != routers.topk:
        raise ReplayError(
            f"the model's routers pick top-{routers.topk}, the routes hold top-{topk} rows"
        )
    axis = _layer_axis(routers, layers, layer_axis)
    _check_ids(routers, routes, axis)
    return axis


def _layer_axis(routers: Routers, layers: int, layer_axis: str | None) -> Literal["all", "moe"]:
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


def _check_ids(routers: Routers, routes: PackedTensor, axis: str) -> None:
    """Ids in range at MoE layers; dense layers hold no routes (zeros, or the distinct
    placeholder rows r3data writes where the engine sent none)."""
    values = routes.values
    if not values.numel():
        return
    dense = sorted(set(range(routers.num_layers)) - set(routers.moe_layers))
    columns = values[:, list(routers.moe_layers)] if axis == "all" and dense else values
    if columns.dtype in _WIDENED:  # torch has no min or max of these on the CPU
        columns = columns.to(torch.int64)
    low, high = (int(v) for v in torch.aminmax(columns))
    if low < 0 or high >= routers.choices:
        raise ReplayError(
            f"routes hold expert id {low if low < 0 else high}; this model's routers pick "
            f"from {routers.choices} experts (ids 0..{routers.choices - 1})"
        )
    if axis != "all" or not dense:
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


def _check_distinct(routers: Routers, per_layer: dict[int, torch.Tensor], inputs: HFInputs) -> None:
    """Refuse a token whose replayed experts repeat one (a router picks ``topk`` distinct
    experts; a repeat would send the token to that expert twice, or to fewer than ``topk``),
    checked on the device the routes replay from, with one synchronisation."""
    topk = routers.topk
    if topk < 2 or not per_layer or not inputs.num_tokens:
        return
    flags = torch.stack(
        [
            torch.stack([(t[:, s:] == t[:, :-s]).any() for s in range(1, topk)]).any()
            for t in per_layer.values()
        ]
    )
    if not bool(flags.any()):
        return
    layer, routes = next(
        (layer, t)
        for (layer, t), flag in zip(per_layer.items(), flags.tolist(), strict=True)
        if flag
    )
    ordered = routes.sort(dim=-1).values
    token = int(torch.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(-1))[0])
    row = int(inputs.index[token])
    where = "at padding" if row == PAD else f"at row {row}"
    raise ReplayError(
        f"layer {layer}'s router picks {topk} distinct experts, the routes give it "
        f"{routes[token].tolist()} {where} (a repeated id is no route: an engine's zero row, "
        "or a corrupt one)"
    )


def _check_inputs(inputs: object) -> None:
    if not isinstance(inputs, HFInputs):
        raise ReplayError(f"inputs must come from hf_inputs(batch), found {type(inputs).__name__}")


def _on_device(
    routers: Routers, per_layer: list[torch.Tensor], device: torch.device
) -> dict[int, torch.Tensor]:
    return {site.layer: t.to(device) for site, t in zip(routers.sites, per_layer, strict=True)}
