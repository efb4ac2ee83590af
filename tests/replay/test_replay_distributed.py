"""Replay through real megatron-core routers on a 4-rank gloo grid: TP 2 x CP 2 with sequence
parallelism, PP 2 (x TP 2, uneven stages, dense layers) and CP 4; THD and BSHD, micro-batch
1 and 2. What each rank checks is in ``replay_worker``; here the parent checks that the
ranks together cover every token exactly once per stage.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import replay_worker

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from rank_helpers import spawn_ranks
from realparts import free_port

WORLD = 4
DEADLINE_S = 240


@pytest.fixture(scope="module")
def reports():
    return spawn_ranks(replay_worker.run, WORLD, (WORLD, free_port()), DEADLINE_S)


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("grid", list(replay_worker.GRIDS))
def test_every_rank_replays_exactly_its_tokens(reports, grid):
    by_rank = {rank: report[grid] for rank, report in reports.items()}
    spec = replay_worker.GRIDS[grid]
    sp = spec["sp"]
    for case_index, (packed, micro_batch) in enumerate(replay_worker.CASES):
        stages: dict[int, Counter] = {}
        for report in by_rank.values():
            case = report["cases"][case_index]
            assert (case["packed"], case["micro_batch"]) == (packed, micro_batch)
            assert case["routers"] == len(report["moe_layers"]) > 0
            coords = report["coords"]
            if sp or coords["tp"] == 0:  # without SP all TP ranks hold the same tokens
                stages.setdefault(coords["pp"], Counter()).update(case["real_rows"])
        total = sum(by_rank[0]["cases"][case_index]["lengths"])
        for counts in stages.values():
            assert counts == Counter(range(total)), "a token is missing or on two ranks"
        assert len({r["cases"][case_index]["tokens"] for r in by_rank.values()}) == 1
    assert all(r["bshd_cp_checks"] == 4 for r in by_rank.values())


@pytest.mark.slow
@pytest.mark.megatron
def test_pipeline_stages_build_their_own_moe_layers(reports):
    layers = {
        r["pp2_tp2_sp"]["coords"]["pp"]: r["pp2_tp2_sp"]["moe_layers"] for r in reports.values()
    }
    assert layers == {0: [0, 2], 1: [3, 4]}
