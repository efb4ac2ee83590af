"""Benchmark reports: the targets they state, as checks, and the table of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3data.cli.common import render_table

__all__ = ["SUMMARY", "Check", "checks", "number", "table"]

SUMMARY = "summary"
"""Stem of the files ``r3data bench`` writes next to the reports."""


@dataclass(frozen=True)
class Check:
    """One target of one benchmark: the measured value, the target and whether it was met."""

    benchmark: str
    name: str
    value: float | None
    target: float | None
    op: str
    met: bool

    @property
    def unit(self) -> str:
        """``" us"`` for a time in microseconds (a name with ``_us``), else ``"x"`` (a ratio)."""
        return " us" if "_us" in self.name else "x"

    @property
    def margin(self) -> float | None:
        """How far inside (> 1) or outside (< 1) the target the value is."""
        if self.value is None or self.target is None or self.value <= 0 or self.target <= 0:
            return None
        if self.op == ">=":
            return self.value / self.target
        if self.op == "<=":
            return self.target / self.value
        return None


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _op(value: float | None, target: float | None, met: bool) -> str:
    if value is None or target is None:
        return ""
    at_least, at_most = value >= target, value <= target
    if met == at_least and met != at_most:
        return ">="
    if met == at_most and met != at_least:
        return "<="
    return "=" if value == target else ""


def checks(benchmark: str, report: dict[str, Any]) -> list[Check]:
    """Every target a report states (see the module doc)."""
    targets = report.get("targets") or {}
    found: list[Check] = []

    def collect(entry: dict[str, Any], prefix: str) -> None:
        met = entry.get("met")
        if not isinstance(met, dict):
            return
        for name, ok in met.items():
            value, target = number(entry.get(name)), number(targets.get(name))
            found.append(
                Check(
                    benchmark, prefix + name, value, target, _op(value, target, bool(ok)), bool(ok)
                )
            )

    collect(report, "")
    for i, entry in enumerate(report.get("results") or ()):
        if isinstance(entry, dict):
            label = entry.get("layout") or entry.get("name") or str(i)
            collect(entry, f"{label}: ")
    if not found:
        found = [
            Check(benchmark, name, None, None, "", ok)
            for name, ok in targets.items()
            if isinstance(ok, bool)
        ]
    return found


def _value(check: Check) -> str:
    return "-" if check.value is None else f"{check.value:.2f}{check.unit}"


def _target(check: Check) -> str:
    return "-" if check.target is None else f"{check.op} {check.target:g}{check.unit}".strip()


def table(found: list[Check]) -> str:
    rows = [[c.benchmark, c.name, _value(c), _target(c), "yes" if c.met else "NO"] for c in found]
    return render_table(rows, ("benchmark", "check", "measured", "target", "met"))
