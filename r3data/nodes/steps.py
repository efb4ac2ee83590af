"""Optimizer steps, data-parallel shares and micro-batches.

Samples are read in order (or in a seeded permutation, :class:`Shuffle`); every ``batch_size``
of them are the global batch of one optimizer step. Each data-parallel rank takes a disjoint
share of it, balanced by tokens (longest first, to the rank with the fewest tokens among those
still short of an equal count); a share is cut into micro-batches of ``size`` samples, or by
a token budget (:class:`MicroBatches`), with the same number of micro-batches on every rank
(as verl's dynamic batch size makes it: collectives run once per micro-batch on every rank).
Every rank computes every rank's shares from the sample lengths alone, so the plan is the same
everywhere without a message, deterministic for a seed and epoch, and resumable per rank.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3data.errors import ConfigError
from r3data.options import options
from r3data.validate import checked_int

__all__ = ["DataParallel", "MicroBatches", "Shuffle", "agree_on_plan", "plan_step"]


@options
class DataParallel:
    """This process's data-parallel rank among ``size`` ranks; ``from_torch()`` reads both from
    an initialised ``torch.distributed`` process group (the data-parallel group) and keeps it
    as ``group``: a loader made with it checks, once and on every rank, that all ranks of the
    group plan alike (:func:`agree_on_plan`)."""

    rank: int = 0
    size: int = 1
    group: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        checked_int("DataParallel.size", self.size, minimum=1)
        checked_int("DataParallel.rank", self.rank, maximum=self.size - 1)

    @classmethod
    def from_torch(cls, group: Any = None) -> DataParallel:
        """Rank and size in ``group`` (default: the whole world) of ``torch.distributed``."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "DataParallel.from_torch: torch.distributed is not initialised; call "
                "init_process_group first, or give DataParallel(rank=..., size=...)"
            )
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:  # torch's answer for a process outside the group
            raise ConfigError(
                f"DataParallel.from_torch: expected a group this process belongs to (its "
                f"data-parallel group), found one without it (rank {rank})"
            )
        return cls(rank=rank, size=dist.get_world_size(group), group=group)


FAILED = "error"
"""The plan entry of a rank whose loader failed before it could plan (its error)."""


def agree_on_plan(plan: dict[str, Any], group: Any) -> None:
    """Every rank of ``group`` holds the same ``plan`` (a collective, on every rank): ranks that
    split steps differently would train some samples twice and others never, or run different
    numbers of micro-batches, without an error. Each rank raises the same ``ConfigError``,
    naming the first entry that differs and every rank's value of it."""
    import torch.distributed as dist

    plans: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, plan, group=group)
    names = [*dict.fromkeys(name for p in plans for name in p if name != FAILED)]
    for name in [FAILED, *names]:  # a failed rank's error first, then rank 0's order
        values = [p.get(name) for p in plans]
        if any(v != values[0] for v in values):
            found = ", ".join(f"rank {r} {name}={v!r}" for r, v in enumerate(values))
            raise ConfigError(
                f"data-parallel ranks plan differently: expected the same {name} on every rank "
                f"of the group, found {found}; give every rank the same samples and loader "
                f"options ({', '.join(names)})"
            )


@options
class Shuffle:
    """A seeded permutation of a map-style source, a new one per ``epoch`` (as
    ``DistributedSampler(seed=..., shuffle=True).set_epoch(epoch)``)."""

    seed: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        checked_int("Shuffle.seed", self.seed)
        checked_int("Shuffle.epoch", self.epoch)

    def order(self, count: int) -> np.ndarray:
        """The sample indices ``0..count-1`` in this seed's and epoch's order."""
        rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch]))
        return rng.permutation(count)


@options
class MicroBatches:
    """How a rank's share of a step is cut: ``size`` samples per micro-batch (in order), or
    micro-batches of at most ``max_tokens`` tokens each, as few as fit and balanced by tokens
    (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``)."""

    size: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.size is None) == (self.max_tokens is None):
            raise ConfigError(
                f"MicroBatches: expected exactly one of size or max_tokens, found "
                f"size={self.size!r}, max_tokens={self.max_tokens!r}"
            )
        if self.size is not None:
            checked_int("MicroBatches.size", self.size, minimum=1)
        if self.max_tokens is not None:
            checked_int("MicroBatches.max_tokens", self.max_tokens, minimum=1)


def _balanced(lengths: np.ndarray, parts: int, *, equal_counts: bool) -> list[list[int]]:
    """Positions of ``lengths`` in ``parts`` groups balanced by tokens, longest first to the
    lightest group; ties go to the lower group. With ``equal_counts`` the groups' sizes differ
    by at most one (a group is full at ``n // parts`` once the ``n % parts`` larger ones are
    taken)."""
    base, larger = divmod(lengths.size, parts)
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, g) for g in range(parts)]
    for position in np.lexsort((np.arange(lengths.size), -lengths)).tolist():
        tokens, g = heapq.heappop(heap)
        while equal_counts and len(groups[g]) >= base + (larger > 0):  # full: leaves the heap
            tokens, g = heapq.heappop(heap)
        groups[g].append(position)
        if equal_counts and len(groups[g]) == base + 1:
            larger -= 1
        heapq.heappush(heap, (tokens + int(lengths[position]), g))
    return [sorted(g) for g in groups]


def _by_budget(lengths: np.ndarray, count: int) -> list[list[int]]:
    bins = _balanced(lengths, count, equal_counts=False)
    return sorted(bins, key=lambda b: (not b, b[:1]))


def _fits(bins: list[list[int]], lengths: np.ndarray, budget: int) -> bool:
    return all(int(lengths[b].sum()) <= budget for b in bins)


def plan_step(
    lengths: Sequence[int] | np.ndarray, dp_size: int, micro: MicroBatches | None
) -> list[list[list[int]]]:
    """For each data-parallel rank, its micro-batches of one step: positions into ``lengths``
    (the token counts of the step's samples), ascending within each micro-batch.

    Every rank gets the same number of micro-batches; a rank with fewer samples than that
    (only in a short last step, or when one long sample fills a budget alone) gets empty ones.
    A sample longer than ``max_tokens`` is a :class:`ConfigError`.
    """
    lengths = np.asarray(lengths, np.int64)
    shares = (
        _balanced(lengths, dp_size, equal_counts=True)
        if dp_size > 1
        else [list(range(lengths.size))]
    )
    if micro is None:
        return [[share] for share in shares]
    if micro.size is not None:
        cuts = [[s[i : i + micro.size] for i in range(0, len(s), micro.size)] for s in shares]
        count = max(1, max(len(c) for c in cuts))
        return [c + [[] for _ in range(count - len(c))] for c in cuts]
    budget = int(micro.max_tokens)  # type: ignore[arg-type]
    if lengths.size and int(lengths.max()) > budget:
        at = int(lengths.argmax())
        raise ConfigError(
            f"MicroBatches.max_tokens={budget}: the sample at position {at} of the step has "
            f"{int(lengths[at])} tokens, more than one micro-batch may hold"
        )
    share_lengths = [lengths[s] for s in shares]
    count = max(max(1, -(-int(t.sum()) // budget)) for t in share_lengths)
    while True:
        plans = [_by_budget(t, count) for t in share_lengths]
        if all(_fits(p, t, budget) for p, t in zip(plans, share_lengths, strict=True)):
            break
        count += 1
    return [
        [[share[i] for i in b] for b in plan] for share, plan in zip(shares, plans, strict=True)
    ]
