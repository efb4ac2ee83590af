"""Two gloo processes with ``DataParallel.from_torch()``: each rank's micro-batches equal the
first-principles reference (``tests/nodes/rank_reference.py``), shuffled, with a short last
step whose lone sample leaves one rank an empty micro-batch; a rank resumed mid-step reads
exactly the rest; options or samples that differ between ranks are one ConfigError on every
rank, naming what differs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import plan_worker
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "nodes"))
from rank_helpers import spawn_ranks
from rank_reference import SampleSpec, rank_micro_batches

WORLD = 2
DEADLINE_S = 90
LENGTHS = [9, 3, 12, 5, 14, 2, 7, 6, 11]  # steps of 4, 4 and 1 samples


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 30)
def test_ranks_of_a_real_group_plan_alike_and_refuse_differing_plans(tmp_path):
    reports = spawn_ranks(
        plan_worker.run, WORLD, (WORLD, str(tmp_path / "store"), LENGTHS), DEADLINE_S
    )
    specs = [SampleSpec(i, n, n) for i, n in enumerate(LENGTHS)]
    shuffle = plan_worker.OPTIONS["shuffle"]
    order = np.random.Generator(np.random.PCG64([shuffle.seed, shuffle.epoch]))
    order = order.permutation(len(LENGTHS)).tolist()
    seen = []
    for rank, report in reports.items():
        want = rank_micro_batches(
            specs,
            batch_size=4,
            dp=WORLD,
            rank=rank,
            micro=("max_tokens", 14),
            order=order,
            drop_last=False,
            start_step=0,
        )
        got = report["whole"]
        assert [g[:4] for g in got] == [w[:4] for w in want], rank
        for step, _, _, indices, routes in got:
            rows = []
            for i in indices:
                rows += [list(specs[i].rows("repeat_previous")[0][p]) for p in range(LENGTHS[i])]
            assert routes == rows, (rank, step)
            seen += indices
        assert report["rest"] == got[plan_worker.CUT :]
    assert sorted(seen) == list(range(len(LENGTHS)))
    assert reports[0]["member"] == "DataParallel(rank=0, size=1)"
    assert reports[1]["member"].startswith(
        "DataParallel.from_torch: expected a group this process belongs to"
    )
    assert any(not g[3] for r in reports.values() for g in r["whole"])  # an empty micro-batch
    for name, message in (
        ("batch_size", "rank 0 batch_size=4, rank 1 batch_size=8"),
        ("micro_batches", "rank 0 micro_batches=[1, None], rank 1 micro_batches=[2, None]"),
        ("shard", "rank 0 samples=5, rank 1 samples=4"),
        ("unreadable", "rank 1 samples='unreadable (OSError: sample 5 is unreadable here)'"),
        ("failed", "rank 0 error=None, rank 1 error='ConfigError: shuffle needs a map-style"),
    ):
        refusals = {report[name] for report in reports.values()}
        assert len(refusals) == 1, name  # the same error on every rank: none waits for another
        (refusal,) = refusals
        assert refusal.startswith("data-parallel ranks plan differently"), refusal
        assert message in refusal, refusal
