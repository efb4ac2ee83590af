"""A first-principles reference for what every data-parallel and (CP, TP) rank must receive
from ``r3data.loader``, written as plain loops from the documented rules and sharing no code
with ``r3data.nodes``:

- every ``batch_size`` samples of the source, in order or in the seeded permutation, are one
  optimizer step (a short last one dropped with ``drop_last``), numbered from ``start_step``;
- each rank's share: longest sample first (ties: the earlier one) to the rank with the fewest
  tokens (ties: the lower rank) among those still short of an equal count (the first
  ``n % dp`` ranks to reach ``n // dp + 1`` samples fill the larger places);
- a share is cut into ``size`` samples per micro-batch in step order, or into the fewest
  micro-batches of at most ``max_tokens`` tokens that fit on every rank (the same greedy,
  without the count rule; micro-batches ordered by their first sample, empty ones last), as
  many on every rank; samples keep their step order inside a micro-batch;
- a sample's rows: the engine's row for every position it produced one, valid; the positions
  it did not (the last token, tokens the requests do not cover) copy the last real row before
  them (``repeat_previous``) or hold experts ``0..topk-1`` (``distinct``), invalid; a hole the
  requests should have covered makes every row distinct and invalid; a sample with no row at
  all is dropped;
- with a layout, a rank holds the rows at the real positions of the reference token order of
  ``tests/layout/layout_reference.py`` for the micro-batch's kept samples, in position order.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1] / "layout"))
from layout_reference import PAD, rank_rows
from layout_reference import runs_of as runs_of  # for the tests beside it

TOPK = 2


def route_row(sample: int, position: int) -> list[int]:
    """The engine's row of one sample at one position (never all zero; ids below 256)."""
    return [1 + position % 250, 1 + sample % 250]


@dataclass(frozen=True)
class SampleSpec:
    """``n`` token ids; requests covering ``covered`` tokens (more or fewer than ``n``) whose
    engine rows are ``[0, covered - 1)`` less the positions of ``hole`` (a gap)."""

    index: int
    n: int
    covered: int
    hole: tuple[int, int] | None = None

    def engine_positions(self) -> list[int]:
        """The positions the engine sent rows for."""
        lo, hi = self.hole or (0, 0)
        return [p for p in range(self.covered - 1) if not lo <= p < hi]

    def real_positions(self) -> list[int]:
        """The engine rows the sample keeps: those of its ``n`` positions (the trace is cut)."""
        return [p for p in self.engine_positions() if p < self.n]

    def dropped(self) -> bool:
        return not self.real_positions()

    def rows(self, placeholder: str) -> tuple[list[list[int]], list[bool]]:
        """Every position's row and whether the engine produced it."""
        real = set(self.real_positions())
        if self.hole is not None and self.hole[0] < self.hole[1]:
            return [list(range(TOPK))] * self.n, [False] * self.n
        rows, valid, previous = [], [], None
        for p in range(self.n):
            if p in real:
                previous = route_row(self.index, p)
                rows.append(previous)
                valid.append(True)
            else:
                distinct = placeholder == "distinct" or previous is None
                rows.append(list(range(TOPK)) if distinct else previous)
                valid.append(False)
        return rows, valid


def step_indices(count, batch_size, order, drop_last):
    """The sample indices of every step."""
    steps = []
    for first in range(0, count, batch_size):
        step = [order[i] for i in range(first, min(count, first + batch_size))]
        if drop_last and len(step) < batch_size:
            break
        steps.append(step)
    return steps


def greedy(lengths, parts, equal_counts):
    """Positions of ``lengths`` in ``parts`` groups, longest first to the lightest open group."""
    groups = [[] for _ in range(parts)]
    tokens = [0] * parts
    base, larger = divmod(len(lengths), parts)
    by_length = sorted(range(len(lengths)), key=lambda p: (-lengths[p], p))
    for p in by_length:
        larger_taken = sum(1 for g in groups if len(g) == base + 1)
        cap = base + 1 if larger_taken < larger else base
        open_groups = [g for g in range(parts) if not equal_counts or len(groups[g]) < cap]
        g = min(open_groups, key=lambda g: (tokens[g], g))
        groups[g].append(p)
        tokens[g] += lengths[p]
    return [sorted(g) for g in groups]


def micro_plan(lengths, dp, micro):
    """Per rank, its micro-batches of step positions (``micro``: None, ("size", n) or
    ("max_tokens", t))."""
    shares = greedy(lengths, dp, True) if dp > 1 else [list(range(len(lengths)))]
    if micro is None:
        return [[s] for s in shares]
    kind, value = micro
    if kind == "size":
        cuts = [[s[i : i + value] for i in range(0, len(s), value)] for s in shares]
        count = max([1] + [len(c) for c in cuts])
        return [c + [[] for _ in range(count - len(c))] for c in cuts]
    share_tokens = [sum(lengths[p] for p in s) for s in shares]
    count = max(max(1, -(-t // value)) for t in share_tokens)
    while True:
        plans = []
        for s in shares:
            bins = greedy([lengths[p] for p in s], count, False)
            bins = [[s[i] for i in b] for b in bins]
            plans.append(sorted(bins, key=lambda b: (not b, b[:1])))
        if all(sum(lengths[p] for p in b) <= value for plan in plans for b in plan):
            return plans
        count += 1


def rank_micro_batches(specs, *, batch_size, dp, rank, micro, order, drop_last, start_step):
    """``(step, micro_batch, micro_batches, [sample index, ...], [the step's indices])`` the
    rank must yield."""
    out = []
    for number, step in enumerate(step_indices(len(specs), batch_size, order, drop_last)):
        plan = micro_plan([specs[i].n for i in step], dp, micro)[rank]
        for k, positions in enumerate(plan):
            out.append((start_step + number, k, len(plan), [step[p] for p in positions], step))
    return out


def local_positions(layout, lengths):
    """Per sample, the real positions this layout's rank holds, ascending."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
    positions = [[] for _ in lengths]
    for row in rank_rows(layout, lengths):
        if row == PAD:
            continue
        b = int(np.searchsorted(offsets, row, "right")) - 1
        positions[b].append(row - offsets[b])
    return [sorted(p) for p in positions]


def expanded(layout, lengths, rows):
    """The rank's ``[local_tokens, topk]`` routes in router order (``rows``: the packed full
    rows of the kept samples); padding tokens hold ``0..topk-1``."""
    return [list(range(TOPK)) if r == PAD else rows[r] for r in rank_rows(layout, lengths)]
