"""One rank of the two-process plan test (spawned by ``test_distributed_plan.py``): loaders
made with ``DataParallel.from_torch()`` over a real gloo group, which plan alike, resume alike,
and refuse, on every rank, options or samples that differ between the ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from r3data import loader
from r3data.errors import ConfigError
from r3data.layout import TokenLayout, expand
from r3data.nodes import DataParallel, Shuffle
from r3data.wire import InlineRows

sys.path.append(str(Path(__file__).resolve().parents[1] / "nodes"))
from rank_reference import route_row

OPTIONS = {
    "batch_size": 4,
    "micro_batches": {"max_tokens": 14},
    "shuffle": Shuffle(seed=5, epoch=1),
    "num_experts": 256,
    "collate": {"workers": 1},
}
CUT = 3


def make_samples(lengths: list[int]) -> list[dict]:
    samples = []
    for i, n in enumerate(lengths):
        rows = np.array([[route_row(i, p)] for p in range(n - 1)], np.uint8).reshape(n - 1, 1, 2)
        request = {"prompt_len": 1, "completion_len": n - 1}
        request["sources"] = [InlineRows("routed_experts", rows, 0)]
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    return samples


def record(batch) -> tuple:
    meta = batch.metadata
    (routes,) = expand(batch["routed_experts"], TokenLayout())  # an empty one too
    return (
        meta["step"],
        meta["micro_batch"],
        meta["micro_batches"],
        list(meta["index"]),
        routes.tolist(),
    )


def refusal(samples, **options) -> str:
    try:
        loader(samples, data_parallel=DataParallel.from_torch(), **{**OPTIONS, **options})
    except ConfigError as exc:
        return str(exc)
    return "accepted"


class Unreadable(list):
    """Samples whose every read fails (a dataset whose storage is gone on one rank)."""

    def __getitem__(self, index):
        raise OSError(f"sample {index} is unreadable here")


def run(rank: int, world: int, store: str, lengths: list[int]) -> dict:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    samples = make_samples(lengths)
    dp = DataParallel.from_torch()
    whole = [record(b) for b in loader(samples, data_parallel=dp, **OPTIONS)]
    first = loader(samples, data_parallel=dp, **OPTIONS)
    it = iter(first)
    for _ in range(CUT):
        next(it)
    resumed = loader(samples, data_parallel=DataParallel.from_torch(), **OPTIONS)
    resumed.load_state_dict(first.state_dict())
    rest = [record(b) for b in resumed]
    solo = dist.new_group([0])  # rank 1 is no member of it
    try:
        member = str(DataParallel.from_torch(solo))
    except ConfigError as exc:
        member = str(exc)
    report = {
        "member": member,
        "whole": whole,
        "rest": rest,
        "batch_size": refusal(samples, batch_size=4 * (rank + 1)),
        "micro_batches": refusal(samples, micro_batches={"size": 1 + rank}),
        "shard": refusal(samples[rank::world]),  # each rank given its own shard
        "unreadable": refusal(Unreadable(samples) if rank else samples),  # no hang
        "failed": refusal(iter(samples) if rank else samples),  # shuffled: refused before the plan
    }
    dist.barrier()
    dist.destroy_process_group()
    return report
