"""One RL step on synthetic rollouts, end to end: the work behind ``r3data demo``.

Rollouts are served half inline (raw producer bodies) and half by handle (payload files under
a root with retention), streamed through :func:`r3data.loader`, checked row by row against the
routes the engine produced, expanded for every rank of a TP 2 x CP 2 grid with sequence
parallelism, and, when megatron-core is installed, replayed through real Megatron routers.
Every payload file is claimed by its batch and deleted by retention once the batch is trained.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from r3data.batch import TensorBatch
from r3data.layout import PAD, TokenLayout, expand
from r3data.nodes import CollateOptions, MicroBatches, loader
from r3data.packed import PackedTensor
from r3data.payload import PayloadRetention, PayloadWriter
from r3data.replay.megatron_check import ReplayOutcome, check_replay
from r3data.synth.models import ModelShape
from r3data.synth.rollouts import Rollout, SyntheticRouter, synth_rollouts
from r3data.synth.serve import ServedRollouts, serve_rollouts
from r3data.trace import ROUTES_FIELD, StitchStats
from r3data.validate import checked_int

__all__ = ["GRID", "RankLoad", "StepReport", "play_step"]

GRID = {"tp_size": 2, "cp_size": 2, "sequence_parallel": True}
"""The demo's parallel layout: TP 2 x CP 2, sequence parallel, THD packing."""

Progress = Callable[[Iterable[Any], str, int], Iterable[Any]]


def _no_progress(items: Iterable[Any], desc: str, total: int) -> Iterable[Any]:
    return items


@dataclass(frozen=True)
class RankLoad:
    """Tokens one (TP, CP) rank's routers see in the step, padding included."""

    tp_rank: int
    cp_rank: int
    local_tokens: int
    padding_tokens: int
    route_bytes: int
    """Bytes of the rank's per-layer int32 routes."""


@dataclass(frozen=True)
class StepReport:
    """What one step moved and what it checked."""

    shape: ModelShape
    rollouts: int
    requests: int
    tokens: int
    micro_batches: int
    served: ServedRollouts
    packed_bytes: int
    padded_bytes: int
    """Bytes each batch's routes would take as a ``[B, max_len, layers, topk]`` rectangle."""
    load_seconds: float
    stats: StitchStats
    rows_checked: int
    mismatches: tuple[str, ...]
    files_deleted: int
    bytes_deleted: int
    files_left: int
    ranks: tuple[RankLoad, ...]
    layout_errors: tuple[str, ...]
    replay: ReplayOutcome

    @property
    def ok(self) -> bool:
        """Routes, layout and retention all checked out (replay is reported separately)."""
        return not self.mismatches and not self.layout_errors and self.files_left == 0


def _check_routes(batch: TensorBatch, rollouts: dict[str, Rollout], zeroed: set[str]) -> list[str]:
    """Compare each sample's routes with the engine's: rows equal where valid, the final token
    a copy of the one before, and a rollout with zeroed routes never valid."""
    problems = []
    for b, sample_id in enumerate(batch["sample_id"]):
        rollout = rollouts[sample_id]
        routes = batch[ROUTES_FIELD][b].numpy()
        valid = batch[f"{ROUTES_FIELD}_valid"][b].numpy()
        forwarded = rollout.tokens - 1
        if sample_id in zeroed:
            if valid.any():
                problems.append(f"{sample_id}: zero routes were marked valid")
            continue
        if not valid[:forwarded].all() or valid[forwarded:].any():
            problems.append(
                f"{sample_id}: valid mask wrong at {np.flatnonzero(~valid).tolist()[:5]}"
            )
        if not np.array_equal(routes[:forwarded], rollout.routes):
            first = int(np.flatnonzero((routes[:forwarded] != rollout.routes).any((1, 2)))[0])
            problems.append(f"{sample_id}: routes differ from the engine's at position {first}")
        if forwarded and not np.array_equal(routes[forwarded], routes[forwarded - 1]):
            problems.append(f"{sample_id}: final-token placeholder is not the previous row")
    return problems


def _rank_layouts(shape: ModelShape) -> list[TokenLayout]:
    return [
        TokenLayout(tp_rank=tp, cp_rank=cp, layers=shape.layers, **GRID)
        for cp in range(GRID["cp_size"])
        for tp in range(GRID["tp_size"])
    ]


def _expand_ranks(
    routes: PackedTensor, shape: ModelShape, problems: list[str]
) -> list[tuple[TokenLayout, list[torch.Tensor], np.ndarray]]:
    """Every rank's per-layer routes; checks that each real row lands on exactly one rank with
    its MoE layers, and that padding rows hold distinct experts."""
    lengths = routes.lengths
    moe = torch.tensor(shape.moe_layer_ids)
    seen = np.zeros(routes.total_rows, dtype=np.int64)
    expanded = []
    for layout in _rank_layouts(shape):
        index = layout.token_index(lengths)
        per_layer = expand(routes, layout)
        stacked = torch.stack(per_layer, 1)
        real = index != PAD
        np.add.at(seen, index[real], 1)
        want = routes.values[torch.from_numpy(index[real])].index_select(1, moe).to(torch.int32)
        where = f"rank tp{layout.tp_rank} cp{layout.cp_rank}"
        if not torch.equal(stacked[torch.from_numpy(real)], want):
            problems.append(f"{where}: expanded routes differ from the batch's rows")
        pads = stacked[torch.from_numpy(~real)]
        if pads.numel() and not torch.equal(pads, torch.arange(shape.topk).expand_as(pads).int()):
            problems.append(f"{where}: padding rows do not hold distinct experts")
        expanded.append((layout, per_layer, index))
    if (seen != 1).any():
        problems.append(
            f"{int((seen == 0).sum())} rows on no rank, {int((seen > 1).sum())} on several"
        )
    return expanded


def _bug_rollouts(rolls: Sequence[Rollout], count: int) -> set[int]:
    """Inline (even) rollouts of several turns, whose last turn will carry zero routes: the
    earlier turns still tell the trace the routes' shape and dtype."""
    multi_turn = [i for i in range(0, len(rolls), 2) if len(rolls[i].requests) > 1]
    return set(multi_turn[:count])


def play_step(
    shape: ModelShape,
    payload_root: str | os.PathLike[str],
    *,
    rollouts: int = 64,
    micro_batches: int = 4,
    seed: int = 0,
    max_turns: int = 3,
    max_len: int = 16384,
    producers: Sequence[str] = ("vllm", "prime-rl"),
    engine_bugs: int = 1,
    workers: int | None = None,
    replay: bool = True,
    progress: Progress = _no_progress,
) -> StepReport:
    """Play one step on ``rollouts`` synthetic rollouts of ``shape`` (see the module doc).

    The loader yields the step's batch as ``micro_batches`` micro-batches (every file claimed
    by retention for step 0), each expanded for every rank. ``payload_root`` must be a fresh
    local directory: retention removes every ``v<k>`` under it. ``engine_bugs`` inline
    multi-turn rollouts get all-zero routes in their last request (a known engine bug): their
    routes must come out as placeholders, never valid.
    """
    checked_int("rollouts", rollouts, minimum=1)
    checked_int("micro_batches", micro_batches, minimum=1)
    checked_int("engine_bugs", engine_bugs)
    router = SyntheticRouter(shape, seed=seed)
    rolls = synth_rollouts(router, rollouts, seed=seed, max_turns=max_turns, max_len=max_len)
    retention = PayloadRetention(os.fspath(payload_root), max_off_policy_steps=1, fresh=True)
    served = serve_rollouts(
        rolls,
        producers=producers,
        writer=PayloadWriter(payload_root),
        zero_routes=_bug_rollouts(rolls, engine_bugs),
        progress=lambda items: progress(items, "serve", rollouts),
    )
    size = -(-rollouts // micro_batches)  # M micro-batches, or fewer where rollouts run out
    pipeline = loader(
        served.samples,
        batch_size=rollouts,
        micro_batches=MicroBatches(size=size),
        num_experts=shape.num_experts,
        retention=retention,
        collate=CollateOptions(workers=workers),
    )
    started = time.perf_counter()
    micro = list(progress(pipeline, "load", -(-rollouts // size)))
    load_seconds = time.perf_counter() - started
    batch = TensorBatch.cat(micro)

    routes = batch[ROUTES_FIELD]
    mismatches = _check_routes(
        batch, {r.rollout_id: r for r in rolls}, set(served.zero_route_rollouts)
    )
    layout_errors: list[str] = []
    loads: dict[tuple[int, int], list[int]] = {}
    outcome = ReplayOutcome("skipped", "not asked for")
    for k, part in enumerate(progress(micro, "train", len(micro))):
        expanded = _expand_ranks(part[ROUTES_FIELD], shape, layout_errors)
        for layout, per_layer, index in expanded:
            load = loads.setdefault((layout.tp_rank, layout.cp_rank), [0, 0, 0])
            load[0] += index.size
            load[1] += int((index == PAD).sum())
            load[2] += sum(t.nbytes for t in per_layer)
        if replay and k == 0:
            outcome = check_replay(
                expanded[0][1], num_experts=shape.num_experts, num_layers=shape.num_layers
            )
    retention.on_policy_update(batch.metadata["step"])
    retention.wait()
    metrics = retention.metrics()
    return StepReport(
        shape=shape,
        rollouts=rollouts,
        requests=sum(len(r.requests) for r in rolls),
        tokens=sum(r.tokens for r in rolls),
        micro_batches=len(micro),
        served=served,
        packed_bytes=routes.values.nbytes,
        padded_bytes=len(routes) * routes.max_length() * routes.values[:1].nbytes,
        load_seconds=load_seconds,
        stats=batch.metadata["stats"],
        rows_checked=routes.total_rows,
        mismatches=tuple(mismatches),
        files_deleted=metrics.files_deleted,
        bytes_deleted=metrics.bytes_deleted,
        files_left=sum(len(names) for _, _, names in os.walk(payload_root)),
        ranks=tuple(RankLoad(tp, cp, *load) for (tp, cp), load in sorted(loads.items())),
        layout_errors=tuple(layout_errors),
        replay=outcome,
    )
