"""Routing agreement: how often the trainer's own router would have picked the replayed experts.

RL users watch it to see how far the trainer drifts from inference. During a replay the tap
already holds both picks for every token, so :class:`AgreementTally` adds two comparisons
per layer on the device and synchronises only when :class:`RoutingAgreement` is read.
:func:`compare_routes` gives the same numbers for two route sets (e.g. two recordings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from r3data.errors import ReplayError
from r3data.packed import PackedTensor

__all__ = ["AgreementTally", "RoutingAgreement", "compare_routes", "overlap_counts"]


@dataclass(frozen=True)
class RoutingAgreement:
    """Per MoE layer: the share of tokens whose trainer top-k set equals the replayed set
    (``exact``), the mean share of the k replayed experts the trainer also picked
    (``overlap``), and with a score threshold the share of replayed slots it replaced."""

    layers: tuple[int, ...]
    """Decoder layer of each entry."""
    tokens: int
    """Real (non-padding) tokens counted per layer."""
    exact: tuple[float, ...]
    overlap: tuple[float, ...]
    replaced: tuple[float, ...] | None = None

    @property
    def mean_exact(self) -> float:
        return sum(self.exact) / len(self.exact) if self.exact else 1.0

    @property
    def mean_overlap(self) -> float:
        return sum(self.overlap) / len(self.overlap) if self.overlap else 1.0

    @property
    def replace_rate(self) -> float | None:
        """Share of all replayed slots the score threshold replaced (None: no threshold)."""
        if self.replaced is None:
            return None
        return sum(self.replaced) / len(self.replaced) if self.replaced else 0.0

    def worst(self, n: int = 3) -> list[tuple[int, float]]:
        """The ``n`` layers with the lowest exact agreement, as ``(layer, exact)``."""
        ranked = sorted(zip(self.layers, self.exact, strict=True), key=lambda pair: pair[1])
        return ranked[:n]

    def as_dict(self) -> dict:
        """Flat numbers for a metrics logger (``worst_layers``: up to three that disagree)."""
        out = {
            "tokens": self.tokens,
            "exact": self.mean_exact,
            "overlap": self.mean_overlap,
            "worst_layers": [layer for layer, exact in self.worst() if exact < 1.0],
        }
        if self.replaced is not None:
            out["replace_rate"] = self.replace_rate
        return out


def overlap_counts(own: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """``[tokens]``: how many of each token's replayed experts are in its own top-k."""
    return (own.unsqueeze(-1) == replayed.unsqueeze(-2)).any(-1).sum(-1)


class AgreementTally:
    """Device-side sums per layer, filled during forwards; read once as RoutingAgreement."""

    def __init__(self, layers: Sequence[int], topk: int, device: torch.device) -> None:
        self.layers = tuple(layers)
        self.topk = topk
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        # columns: tokens, exact matches, overlapping experts, replaced slots
        self._sums = torch.zeros(len(self.layers), 4, dtype=torch.int64, device=device)
        self.thresholded = False

    def add(
        self,
        layer: int,
        own: torch.Tensor,
        replayed: torch.Tensor,
        real: torch.Tensor,
        replaced: torch.Tensor | None = None,
    ) -> None:
        """Count one call: ``own``/``replayed`` ``[T, k]``; ``real`` ``[T]`` bool marks the
        tokens to count."""
        overlap = overlap_counts(own, replayed.to(own.device, own.dtype)) * real
        row = torch.stack(
            [
                real.sum(),
                ((overlap == self.topk) & real).sum(),
                overlap.sum(),
                torch.zeros((), dtype=torch.int64, device=real.device)
                if replaced is None
                else (replaced.sum(-1) * real).sum(),
            ]
        )
        self._sums[self._row[layer]] += row.to(self._sums.device)
        self.thresholded |= replaced is not None

    def result(self) -> RoutingAgreement:
        sums = self._sums.cpu().tolist()  # the one synchronisation
        tokens = [row[0] for row in sums]
        return RoutingAgreement(
            layers=self.layers,
            tokens=max(tokens, default=0),
            exact=tuple(row[1] / row[0] if row[0] else 1.0 for row in sums),
            overlap=tuple(row[2] / (row[0] * self.topk) if row[0] else 1.0 for row in sums),
            replaced=tuple(row[3] / (row[0] * self.topk) if row[0] else 0.0 for row in sums)
            if self.thresholded
            else None,
        )


def compare_routes(
    own: PackedTensor, replayed: PackedTensor, layers: Sequence[int] | None = None
) -> RoutingAgreement:
    """Agreement between two route sets of the same samples (rows ``[layers, topk]``)."""
    for name, routes in (("own", own), ("replayed", replayed)):
        if not isinstance(routes, PackedTensor) or len(routes.row_shape) != 2:
            found = getattr(routes, "row_shape", type(routes).__name__)
            raise ReplayError(f"{name} must be routes [rows, layers, topk], found {found}")
    if own.row_shape != replayed.row_shape or not (own.lengths == replayed.lengths).all():
        raise ReplayError(
            f"route sets must have the same samples and row shape, found {own.row_shape} "
            f"over lengths {own.lengths.tolist()} and {replayed.row_shape} over "
            f"{replayed.lengths.tolist()}"
        )
    count, topk = own.row_shape
    layers = tuple(range(count)) if layers is None else tuple(layers)
    if len(layers) != count:
        raise ReplayError(f"layers must name {count} layers, found {len(layers)}")
    tally = AgreementTally(layers, topk, torch.device("cpu"))
    mine, theirs = own.values.long().cpu(), replayed.values.long().cpu()
    real = torch.ones(mine.shape[0], dtype=torch.bool)
    for j, layer in enumerate(layers):
        tally.add(layer, mine[:, j], theirs[:, j], real)
    return tally.result()
