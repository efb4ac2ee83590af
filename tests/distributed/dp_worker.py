"""One rank of the 4-process trainer test (spawned by ``test_distributed_steps.py``).

The grid is DP 2 x CP 2 over a real gloo group; every rank loads the same samples from one
shared payload root, its DP share of each optimizer step in token-budget micro-batches, read
rank-local for its CP rank. Two runs on two copies of the root: one uninterrupted, one that
checkpoints the loader after step 0, drops loader and retention (a crash) and resumes both.
After each step every rank calls ``on_policy_update``; rank 0 then checks that exactly the
files no later step reads are gone. Each rank reports, per micro-batch, its step, number,
sample ids and a digest of every field's bytes.
"""

from __future__ import annotations

import hashlib
import os
import pickle

import torch
import torch.distributed as dist

from r3data import TensorBatch, loader
from r3data.layout import TokenLayout, expand
from r3data.nodes import DataParallel, MicroBatches
from r3data.payload import PayloadRetention

DP, CP = 2, 2
BATCH_SIZE = 8
MAX_TOKENS = 64


def digest(batch: TensorBatch) -> str:
    """Every field's bytes and offsets, and the rank's expanded routes."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        if isinstance(value, list):
            h.update(repr(value).encode())
            continue
        h.update(value.offsets.tobytes())
        h.update(value.values.contiguous().view(torch.uint8).numpy().tobytes())
    for layer in expand(batch["routed_experts"]):
        h.update(layer.contiguous().numpy().tobytes())
    return h.hexdigest()


def _check_files(root: str, last_step: dict[str, int], step: int, *, consumed: bool) -> None:
    """No file is gone before its last step; with ``consumed``, every file is gone after it."""
    for name, last in last_step.items():
        exists = os.path.exists(os.path.join(root, name))
        if exists != (last > step) and (consumed or not exists):
            raise AssertionError(
                f"after step {step}: {name} (last read at step {last}) "
                f"{'still exists' if exists else 'was deleted early'}"
            )


def _train(root, samples, last_step, layout, dp, state=None, stop_after=None, off_policy=4):
    """Micro-batch records of one (part of a) run; the loader's state after ``stop_after``.
    A list's files go at the update of their last step; a stream's (a later sample may name
    them) by the backstop, ``off_policy`` steps after their version."""
    retention = PayloadRetention(
        root, max_off_policy_steps=off_policy, fresh=False, group=dist.group.WORLD
    )
    pipeline = loader(
        samples,
        batch_size=BATCH_SIZE,
        data_parallel=dp,
        micro_batches=MicroBatches(max_tokens=MAX_TOKENS),
        layout=layout,
        retention=retention,
        collate={"workers": 1},
    )
    if state is not None:
        pipeline.load_state_dict(state)
    records = []
    for batch in pipeline:
        meta = batch.metadata
        records.append(
            (
                meta["step"],
                meta["micro_batch"],
                meta["micro_batches"],
                batch["sample_id"],
                int(batch["token_ids"].total_rows),
                digest(batch),
            )
        )
        if meta["micro_batch"] + 1 < meta["micro_batches"]:
            continue
        retention.on_policy_update(meta["step"])  # every rank: rank 0 deletes once all did
        retention.wait()
        dist.barrier()
        if dist.get_rank() == 0:
            _check_files(root, last_step, meta["step"], consumed=not isinstance(samples, Stream))
        dist.barrier()
        if meta["step"] == stop_after:
            return records, pipeline.state_dict(), retention.metrics().files_deleted
    return records, None, retention.metrics().files_deleted


class Stream:
    """The samples as a stream: iterable again, but no length and no indexing."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def run(rank: int, world: int, store: str, job: str) -> dict:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    with open(job, "rb") as f:
        roots, samples, last_step, (stream, stream_last) = pickle.load(f)
    dp_groups = [dist.new_group([cp + CP * d for d in range(DP)]) for cp in range(CP)]
    dp = DataParallel.from_torch(dp_groups[rank % CP])  # this rank's data-parallel group
    if dp != DataParallel(rank=rank // CP, size=DP):
        raise AssertionError(f"DataParallel.from_torch gave {dp}")
    layout = TokenLayout(cp_size=CP, cp_rank=rank % CP)
    whole, _, deleted = _train(roots[0], samples, last_step, layout, dp)
    first, state, deleted_before = _train(roots[1], samples, last_step, layout, dp, stop_after=0)
    rest, _, deleted_after = _train(roots[1], samples, last_step, layout, dp, state=state)
    streamed, _, deleted_streamed = _train(
        roots[2], Stream(stream), stream_last, layout, dp, off_policy=1
    )
    report = {
        "coords": (rank // CP, rank % CP),
        "whole": whole,
        "resumed": first + rest,
        "stream": [sid for record in streamed for sid in record[3]],
        "deleted": (deleted, deleted_before + deleted_after, deleted_streamed),
        "left": [sum(len(n) for _, _, n in os.walk(root)) for root in roots],
    }
    dist.barrier()
    dist.destroy_process_group()
    return report
