"""Plots of benchmark reports: seconds per arm, and every check's margin to its target."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from r3data.cli.bench_report import SUMMARY, Check, number

__all__ = ["write_plots"]

MARGIN_TICKS = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)


def _timings(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Seconds per arm, grouped: the report's own, each distribution's, each result's."""
    groups: dict[str, dict[str, float]] = {}
    for key in ("seconds_best", "seconds"):
        if isinstance(report.get(key), dict):
            groups[""] = report[key]
            break
    entries = list((report.get("distributions") or {}).items())
    entries += [
        (e.get("layout") or e.get("name") or str(i), e)
        for i, e in enumerate(report.get("results") or ())
        if isinstance(e, dict)
    ]
    for label, entry in entries:
        for key in ("seconds_best", "seconds", "seconds_median"):
            if isinstance(entry.get(key), dict):
                groups[label] = entry[key]
                break
    return {
        label: {arm: float(s) for arm, s in arms.items() if number(s) is not None}
        for label, arms in groups.items()
    }


def write_plots(
    reports: dict[str, dict[str, Any]], found: list[Check], results: Path
) -> list[Path]:
    """``<name>.png`` (seconds per arm) per benchmark and ``summary.png`` (margins to target);
    nothing when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    written = []
    for name, report in reports.items():
        groups = _timings(report)
        if not groups:
            continue
        fig = Figure(figsize=(8, 1.2 + 0.5 * sum(len(a) for a in groups.values())))
        ax = fig.subplots()
        labels, seconds = [], []
        for group, arms in groups.items():
            for arm, value in arms.items():
                labels.append(f"{group} {arm}".strip())
                seconds.append(value)
        ax.barh(labels[::-1], seconds[::-1], color="tab:blue")
        ax.set_xlabel("seconds (lower is better)")
        ax.set_title(f"bench_{name}")
        fig.tight_layout()
        path = results / f"bench_{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    plotted = [c for c in found if c.margin is not None]
    if plotted:
        fig = Figure(figsize=(8, 1.2 + 0.4 * len(plotted)))
        ax = fig.subplots()
        labels = [f"{c.benchmark}: {c.name}" for c in plotted][::-1]
        margins = [c.margin for c in plotted][::-1]
        colors = ["tab:green" if c.met else "tab:red" for c in plotted][::-1]
        ax.barh(labels, margins, color=colors)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xscale("log")
        low, high = min(margins), max(margins)
        ax.set_xticks([t for t in MARGIN_TICKS if low / 2 < t < high * 2])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("margin to target (> 1x: target met)")
        fig.tight_layout()
        path = results / f"{SUMMARY}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
