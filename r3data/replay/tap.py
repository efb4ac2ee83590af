"""Replay routes inside a router's own forward by standing in for its one top-k.

A MoE router picks experts with one top-k over ``[tokens, experts]`` scores, then computes
the routing weights from the picked experts with its own scoring, normalisation, bias and
scaling. While a router runs, a :class:`TopkTap` (a ``TorchFunctionMode``) lets that one
top-k run, hands the trainer's own pick to a callback, and returns what the callback
chooses (the replayed experts) with the scores gathered at them. The router's own code then
computes the weights from its own scores at the replayed experts, differentiably, whatever
its family does. Other top-k calls (a group-limited choice over groups, ...) pass through.

:class:`RouterSite` names one router (the module and method holding its top-k) and
:func:`tap_routers` installs a wrapper on each site for as long as any session (a record or
a replay, by Hugging Face or torchtitan) is open on it. Wrappers are keyed by module, so
activation checkpointing's recompute of a layer reaches the same routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from r3data.errors import ReplayError

__all__ = [
    "RouterSite",
    "Session",
    "TopkTap",
    "carried",
    "in_backward",
    "single_group_passes",
    "tap_routers",
]

_TOPK = (torch.topk, torch.Tensor.topk)
#: A group-limited choice masks the scores of the groups not chosen before its top-k.
_MASKS = (torch.masked_fill, torch.Tensor.masked_fill)
#: Shape changes a masked score tensor may take on the way to the top-k.
_RESHAPES = (
    torch.flatten,
    torch.Tensor.flatten,
    torch.reshape,
    torch.Tensor.reshape,
    torch.Tensor.view,
    torch.unflatten,
    torch.Tensor.unflatten,
)


@dataclass(frozen=True, eq=False)
class RouterSite:
    """One router: ``getattr(module, method)`` runs its top-k over ``choices`` columns."""

    layer: int
    """Decoder layer the router belongs to."""
    module: torch.nn.Module
    method: str
    topk: int
    choices: int
    name: str
    """Qualified module name, for messages."""
    carries: str = "indices"
    """How the output carries the pick: ``"indices"`` (the index tensor itself) or
    ``"scores"`` (dense ``[tokens, choices]`` scores, zero off the pick: Llama4)."""
    selects_on_logits: bool = False
    """The top-k runs on scores that can be negative (raw logits, GPT-OSS style), not on
    probabilities; the score threshold then compares their softmax."""
    probed: bool = False
    """The contract was learnt before any forward (else it is checked at the first call)."""
    passes: int = 0
    """Top-k calls of ``topk`` over ``choices`` before the router's own that are not its pick:
    a group-limited choice with a single group (``n_group=1``) takes each group's top-2 over
    all the experts, which with ``topk=2`` looks like the router's and steers nothing (the one
    group is always kept). They run untouched (see :func:`single_group_passes`)."""


Choose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
"""``choose(scores [T, choices], own [T, k]) -> indices [T, k]`` (None: keep own)."""


class TopkTap(TorchFunctionMode):
    """Stand in for the top-k over ``choices`` columns with ``k`` picks (see the module doc)."""

    def __init__(self, k: int, choices: int, choose: Choose | None = None, passes: int = 0) -> None:
        super().__init__()
        self.k = k
        self.choices = choices
        self.choose = choose
        self.passes = passes
        self.calls = 0
        self.single_group: list[bool] = []
        """Per call taken for the router's, whether it ran over a group axis of one
        (``[..., 1, choices]``)."""
        self.scores: torch.Tensor | None = None
        self.own: torch.Tensor | None = None
        self.used: torch.Tensor | None = None
        self._unmasked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """``id(masked) -> (masked, the same scores before any mask)``, for this call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MASKS or func in _RESHAPES:
            return self._track(func, args, kwargs)
        if func not in _TOPK or not self._selects(args, kwargs):
            return func(*args, **kwargs)
        scores = args[0] if args else kwargs.get("input", kwargs.get("self"))
        grouped = scores.dim() >= 3 and scores.shape[-2] == 1
        if self.passes:
            if not grouped:
                raise ReplayError(
                    f"the router's first top-k of k={self.k} ran over {tuple(scores.shape)}, "
                    f"expected the [..., 1, {self.choices}] of its single group, as probed"
                )
            self.passes -= 1
            return func(*args, **kwargs)
        values, own = func(*args, **kwargs)
        self.calls += 1
        self.single_group.append(grouped)
        # the trainer's own scores: a group-limited choice's mask only steers its own pick
        scores = self._before_masks(args[0])
        flat_scores = scores.reshape(-1, self.choices)
        flat_own = own.reshape(-1, self.k)
        picked = None if self.choose is None else self.choose(flat_scores, flat_own)
        self.scores, self.own = flat_scores, flat_own
        if picked is None:
            self.used = own
            return torch.return_types.topk((values, own))
        used = picked.to(own.device, own.dtype).view(own.shape)
        self.used = used
        return torch.return_types.topk((scores.gather(-1, used), used))

    def _track(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a mask or a reshape, remembering the scores before any mask."""
        out = func(*args, **kwargs)
        source = args[0] if args else None
        if not isinstance(out, torch.Tensor) or not isinstance(source, torch.Tensor):
            return out
        if func in _MASKS:
            self._unmasked[id(out)] = (out, self._before_masks(source))
        elif id(source) in self._unmasked and self._unmasked[id(source)][0] is source:
            before = func(self._unmasked[id(source)][1], *args[1:], **kwargs)
            self._unmasked[id(out)] = (out, before)
        return out

    def _before_masks(self, tensor: torch.Tensor) -> torch.Tensor:
        masked, before = self._unmasked.get(id(tensor), (None, tensor))
        return before if masked is tensor else tensor

    def _selects(self, args: tuple, kwargs: dict) -> bool:
        """Is this the router's top-k: ``k`` largest over the last dim of ``choices``?"""
        names = ("input", "k", "dim", "largest")
        given = dict(zip(names, args, strict=False)) | kwargs
        scores = given.get("input", given.get("self"))
        if not isinstance(scores, torch.Tensor) or scores.dim() < 1:
            return False
        dim = given.get("dim", -1)
        return (
            given.get("k") == self.k
            and given.get("largest", True)
            and dim in (-1, scores.dim() - 1)
            and scores.shape[-1] == self.choices
        )


def single_group_passes(tap: TopkTap) -> int:
    """How many of the calls ``tap`` took for the router's are a single group's top-2 before
    the pick (see :attr:`RouterSite.passes`): one when it ran exactly that and then one more."""
    return 1 if tap.k == 2 and tap.single_group == [True, False] else 0


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a router's output (a tensor, or nested tuples and lists of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from tensors_in(item)


def in_backward() -> bool:
    """True while autograd runs a backward pass (activation recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


def carried(site: RouterSite, output: Any, used: torch.Tensor) -> str:
    """How the router's output carries the experts its top-k returned: ``"indices"`` or
    ``"scores"`` (only ``site.carries`` for a probed site); a ReplayError if it does not."""
    kinds = (site.carries,) if site.probed else ("indices", "scores")
    if "indices" in kinds and any(t is used for t in tensors_in(output)):
        return "indices"
    if "scores" in kinds:
        flat = used.reshape(-1, site.topk)
        expected = torch.zeros(flat.shape[0], site.choices, dtype=torch.bool, device=flat.device)
        expected.scatter_(1, flat.long(), True)
        for tensor in tensors_in(output):
            same_size = tensor.is_floating_point() and tensor.numel() == expected.numel()
            if same_size and torch.equal(tensor.reshape(expected.shape) != 0, expected):
                return "scores"
    if kinds == ("scores",):
        raise ReplayError(
            f"router {site.name} ({type(site.module).__name__}) returns no scores that are "
            "non-zero exactly at the picked experts"
        )
    raise ReplayError(
        f"router {site.name} ({type(site.module).__name__}) does not return the experts "
        "its top-k picked (it changes or drops them after the pick), so replayed experts "
        "would not reach its experts"
    )


class Session(Protocol):
    """What a record or a replay does at each call of a router it taps: ``choose`` the
    experts (the site's replay if one is open, else its first record; None keeps the
    router's own), then ``observe`` the call."""

    def choose(
        self, site: RouterSite, scores: torch.Tensor, own: torch.Tensor
    ) -> torch.Tensor | None: ...

    def observe(self, site: RouterSite, tap: TopkTap, output: Any) -> None: ...


@dataclass
class _Hub:
    """The sessions open on one router site, and the method the wrapper stands in for."""

    site: RouterSite
    saved: Any
    """The instance attribute the wrapper replaced (``_MISSING`` when there was none)."""
    replay: Session | None = None
    records: list[Session] = field(default_factory=list)
    checked: bool = False


_EAGER_ROUTER = (
    "r3data replays routes in the router's own forward, which runs eagerly: compile the "
    "model's blocks with fullgraph=False while a record or replay is open"
)
_MISSING = object()
_HUBS: dict[int, _Hub] = {}


def _wrapper(hub: _Hub, original: Callable[..., Any]) -> Callable[..., Any]:
    site = hub.site

    def routed(*args: Any, **kwargs: Any) -> Any:
        replay = hub.replay
        chooser = replay if replay is not None else (hub.records[0] if hub.records else None)
        choose = None if chooser is None else (lambda s, o: chooser.choose(site, s, o))
        tap = TopkTap(site.topk, site.choices, choose, site.passes)
        with tap:
            output = original(*args, **kwargs)
        if tap.calls != 1:
            raise ReplayError(
                f"router {site.name} ({type(site.module).__name__}) ran {tap.calls} top-k "
                f"calls of k={site.topk} over {site.choices} experts, expected exactly one"
            )
        if not hub.checked:
            carried(site, output, tap.used)
            hub.checked = True
        for session in ([replay] if replay is not None else []) + hub.records:
            session.observe(site, tap, output)
        return output

    # the tap's mode and its record of backward cannot be traced: the router runs eagerly
    # (a graph break; torch.compile(fullgraph=True) refuses it with this reason)
    return torch.compiler.disable(routed, reason=_EAGER_ROUTER)


@contextlib.contextmanager
def tap_routers(sites: Sequence[RouterSite], session: Session, *, replays: bool) -> Iterator[None]:
    """Open ``session`` on every site (one replay at a time per site, any number of records)."""
    opened: list[_Hub] = []
    try:
        for site in sites:
            hub = _HUBS.get(id(site.module))
            if hub is None:
                hub = _install(site)
            if replays:
                if hub.replay is not None:
                    raise ReplayError(f"router {site.name} is already replaying other routes")
                hub.replay = session
            else:
                hub.records.append(session)
            opened.append(hub)
        yield
    finally:
        for hub in opened:
            if replays:
                hub.replay = None
            else:
                hub.records.remove(session)
            if hub.replay is None and not hub.records:
                _uninstall(hub)


def _install(site: RouterSite) -> _Hub:
    saved = site.module.__dict__.get(site.method, _MISSING)
    hub = _Hub(site, saved)
    setattr(site.module, site.method, _wrapper(hub, getattr(site.module, site.method)))
    _HUBS[id(site.module)] = hub
    return hub


def _uninstall(hub: _Hub) -> None:
    module = hub.site.module
    del module.__dict__[hub.site.method]
    if hub.saved is not _MISSING:
        module.__dict__[hub.site.method] = hub.saved
    _HUBS.pop(id(module), None)
