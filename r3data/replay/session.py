"""Record and replay sessions over tapped routers (Hugging Face and torchtitan share them).

A :class:`ReplaySession` holds one ``[tokens, topk]`` routes tensor per router site. At
each call it checks the tokens, counts forwards and recomputes, adds the call to the
agreement tally (the trainer's own pick against the replayed one, at the counted tokens:
real ones whose routes are not placeholders) and,
with a score threshold, keeps only the replayed experts the trainer scores well enough.
A :class:`RecordSession` keeps the experts each router used in its (first) forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from r3data.errors import ReplayError
from r3data.replay.agreement import AgreementTally, RoutingAgreement
from r3data.replay.tap import RouterSite, TopkTap, in_backward

__all__ = ["RecordSession", "ReplaySession", "score_threshold"]


def score_threshold(
    scores: torch.Tensor,
    own: torch.Tensor,
    replayed: torch.Tensor,
    ratio: float,
    *,
    logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """prime-rl's score-threshold replay: ``(picked [T, k], replaced [T, k] bool)``.

    A replayed expert is kept when the trainer's own score for it is at least ``ratio``
    times the trainer's weakest own top-k score; each rejected slot takes, in slot order,
    the trainer's best own expert not kept already. ``logits``: the scores are raw logits
    (compared as probabilities, after a softmax over experts).
    """
    probs = torch.softmax(scores.float(), dim=-1) if logits else scores.float()
    replayed = replayed.to(own.device, torch.int64)
    own = own.to(torch.int64)
    weakest = probs.gather(-1, own).min(-1, keepdim=True).values
    kept = probs.gather(-1, replayed) >= ratio * weakest
    # the trainer's own experts, best first, those already kept moved to the end
    own = own.gather(-1, probs.gather(-1, own).argsort(-1, descending=True))
    taken = ((own.unsqueeze(-1) == replayed.unsqueeze(-2)) & kept.unsqueeze(-2)).any(-1)
    fillers = own.gather(-1, taken.to(torch.int8).argsort(dim=-1, stable=True))
    slot = ((~kept).cumsum(-1) - 1).clamp(min=0)
    return torch.where(kept, replayed, fillers.gather(-1, slot)), ~kept


class ReplaySession:
    """Replays ``routes[layer]`` at the router site of each layer (see the module doc)."""

    def __init__(
        self,
        sites: Sequence[RouterSite],
        routes: Mapping[int, torch.Tensor],
        counted: torch.Tensor,
        *,
        threshold: float | None = None,
    ) -> None:
        if threshold is not None and not (
            isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0
        ):
            raise ReplayError(f"threshold must be a ratio > 0, found {threshold!r}")
        self.sites = tuple(sites)
        self.routes = dict(routes)
        self.counted = counted
        self.threshold = threshold
        topk = self.sites[0].topk if self.sites else 1
        self.tally = AgreementTally([s.layer for s in self.sites], topk, counted.device)
        self.forwards = dict.fromkeys(self.routes, 0)
        self.grad_forwards = dict.fromkeys(self.routes, 0)
        self.recomputes = dict.fromkeys(self.routes, 0)

    def choose(self, site: RouterSite, scores: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        routes = self.routes[site.layer]
        if routes.shape[0] != scores.shape[0]:
            raise ReplayError(
                f"router {site.name} (layer {site.layer}) routes {scores.shape[0]} tokens, the "
                f"replayed routes hold {routes.shape[0]}: the model's inputs are not the ones "
                "the routes were laid out for"
            )
        routes = routes.to(own.device, torch.int64)
        replaced = None
        if self.threshold is not None:
            routes, replaced = score_threshold(
                scores, own, routes, self.threshold, logits=site.selects_on_logits
            )
        if in_backward():
            self.recomputes[site.layer] += 1
        else:
            self.forwards[site.layer] += 1
            self.grad_forwards[site.layer] += torch.is_grad_enabled()
            counted = self.counted.to(own.device)
            self.tally.add(site.layer, own, self.routes[site.layer], counted, replaced)
        return routes

    def observe(self, site: RouterSite, tap: TopkTap, output: Any) -> None:
        """Nothing to keep: the tally was filled when the experts were chosen."""

    @property
    def agreement(self) -> RoutingAgreement:
        """Agreement of every forward so far (one device synchronisation)."""
        return self.tally.result()

    def check_recomputed(self, checkpointed: bool) -> None:
        """With activation checkpointing, every forward's recompute must have run inside."""
        if not checkpointed:
            return
        short = [
            layer
            for layer in self.grad_forwards
            if self.recomputes[layer] < self.grad_forwards[layer]
        ]
        if short:
            raise ReplayError(
                f"activation checkpointing is on and the routers of layers {short} ran "
                f"{self.grad_forwards[short[0]]} forwards with gradients but "
                f"{self.recomputes[short[0]]} recomputes inside replay(): call backward() "
                "inside the context, or the recompute routes by the trainer's own top-k"
            )


class RecordSession:
    """Keeps the experts every router used in its first forward (recomputes are skipped).

    With ``padding`` (per layer, ``[tokens, topk]`` whose rows at padding tokens hold the
    fill a replay would give them; ``real`` marks the rest) padding tokens are routed there
    while recording: every expert then sees the same tokens in the recorded forward as in a
    replay of it, which a replay needs to reproduce the recorded forward bit for bit.
    """

    def __init__(
        self,
        sites: Sequence[RouterSite],
        padding: Mapping[int, torch.Tensor] | None = None,
        real: torch.Tensor | None = None,
    ) -> None:
        self.sites = tuple(sites)
        self.padding = None if padding is None else dict(padding)
        self.real = real
        self.used: dict[int, torch.Tensor] = {}
        self.calls = dict.fromkeys((s.layer for s in self.sites), 0)

    def choose(
        self, site: RouterSite, scores: torch.Tensor, own: torch.Tensor
    ) -> torch.Tensor | None:
        if self.padding is None or self.real is None:
            return None
        fill = self.padding[site.layer]
        if fill.shape[0] != own.shape[0]:
            raise ReplayError(
                f"router {site.name} (layer {site.layer}) routes {own.shape[0]} tokens, the "
                f"recorded inputs hold {fill.shape[0]}"
            )
        real = self.real.to(own.device)
        return torch.where(real.unsqueeze(-1), own, fill.to(own.device, own.dtype))

    def observe(self, site: RouterSite, tap: TopkTap, output: Any) -> None:
        if in_backward():
            return
        self.calls[site.layer] += 1
        if site.layer not in self.used:
            self.used[site.layer] = tap.used.detach().reshape(-1, site.topk).clone()

    def per_layer(self) -> list[torch.Tensor]:
        """One ``[tokens, topk]`` int64 tensor per MoE layer, in layer order."""
        missing = [s.layer for s in self.sites if s.layer not in self.used]
        if missing:
            raise ReplayError(f"the routers of layers {missing} did not run while recording")
        twice = [layer for layer, n in self.calls.items() if n > 1]
        if twice:
            raise ReplayError(
                f"the routers of layers {twice} ran {self.calls[twice[0]]} forwards while "
                "recording; record one forward per record() context"
            )
        return [self.used[s.layer] for s in self.sites]
