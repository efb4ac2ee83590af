"""Expert-load histograms for the terminal: per expert, and ranked within each layer."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from r3data.cli.common import count
from r3data.errors import WireFormatError
from r3data.nodes.screen import dense_layers
from r3data.synth.expert_load import expert_load

__all__ = ["load_summary", "render_histogram"]

BARS = " ▁▂▃▄▅▆▇█"
ASCII_BARS = " .:-=+*#%@"
EXPERTS_PER_LINE = 64
MAX_EXPERTS = 1 << 16
"""Expert ids a histogram counts (uint16 routes' range): a larger id is corrupt, and counting
up to it would allocate per id."""


def load_summary(routes: list[np.ndarray], num_experts: int | None = None) -> dict[str, Any] | None:
    """Expert load over every array with the first one's row shape; dense layers (zero in
    every array) left out; None when nothing is left to count."""
    routes = [r for r in routes if r.size]
    if not routes:
        return None
    same = [r for r in routes if r.shape[1:] == routes[0].shape[1:]]
    dense = set.intersection(*(set(dense_layers(r)) for r in same))
    layers = [layer for layer in range(same[0].shape[1]) if layer not in dense]
    if not layers:  # every layer all zero: an engine bug, nothing to count
        return None
    experts = num_experts or max(int(r.max()) for r in same) + 1
    if experts > MAX_EXPERTS:
        raise WireFormatError(
            f"expert load: expected expert ids below {MAX_EXPERTS}, found {experts - 1}"
        )
    counts = sum(expert_load(r, experts, layers)[0] for r in same)
    per_expert = counts.sum(axis=0)
    return {
        "experts": experts,
        "moe_layers": layers,
        "arrays": len(same),
        "arrays_skipped": len(routes) - len(same),
        "assignments": int(per_expert.sum()),
        "per_expert": per_expert,
        "per_layer_hottest_over_mean": counts.max(axis=1) / np.maximum(counts.mean(axis=1), 1e-12),
        "ranked_over_mean": np.sort(counts, axis=1)[:, ::-1].mean(axis=0)
        / max(float(counts.mean()), 1e-12),
    }


def _bars() -> str:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        BARS.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return ASCII_BARS
    return BARS


def _bar_lines(values: np.ndarray, bars: str) -> list[str]:
    """``values`` as bar heights, ``EXPERTS_PER_LINE`` to a line, the largest a full bar."""
    levels = np.ceil(values / max(float(values.max()), 1e-12) * (len(bars) - 1)).astype(int)
    return [
        f"  {lo:>4}-{min(lo + EXPERTS_PER_LINE, values.size) - 1:<4} "
        f"|{''.join(bars[v] for v in levels[lo : lo + EXPERTS_PER_LINE])}|"
        for lo in range(0, values.size, EXPERTS_PER_LINE)
    ]


def render_histogram(load: dict[str, Any]) -> list[str]:
    per_expert = np.asarray(load["per_expert"], dtype=np.float64)
    ranked = np.asarray(load["ranked_over_mean"], dtype=np.float64)
    mean = per_expert.mean()
    bars = _bars()
    peaks = np.asarray(load["per_layer_hottest_over_mean"])
    layers = load["moe_layers"]
    worst = int(peaks.argmax())
    lines = [
        f"expert load: {load['assignments']:,} assignments over "
        f"{count(len(layers), 'MoE layer')} and {load['experts']} experts",
        "  by expert id, summed over layers:",
        *_bar_lines(per_expert, bars),
        f"  coolest expert {int(per_expert.argmin())} at {per_expert.min() / mean:.2f}x the mean, "
        f"hottest {int(per_expert.argmax())} at {per_expert.max() / mean:.2f}x",
        "  hottest to coolest within each layer, averaged over layers:",
        *_bar_lines(ranked, bars),
        f"  hottest expert per layer over the layer's mean: median {np.median(peaks):.2f}x, "
        f"worst {peaks[worst]:.2f}x (layer {layers[worst]})",
    ]
    if load["arrays_skipped"]:
        lines.append(f"  ({count(load['arrays_skipped'], 'field')} of another row shape left out)")
    return lines
