"""Four gloo processes, DP 2 x CP 2, one shared payload root: two optimizer steps of
token-budget micro-batches, a checkpoint after the first, every rank resumed. What each rank
does is in ``dp_worker``; here the parent checks the ranks' reports against each other."""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path

import dp_worker
import numpy as np
import pytest

from r3data.payload import PayloadWriter, shift

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from rank_helpers import spawn_ranks

WORLD = 4
DEADLINE_S = 120
SAMPLES, GROUPS = 16, 4
LAYERS, TOPK, EXPERTS = 3, 2, 32


def write_samples(root):
    """GRPO-like groups: the first turn of samples g, g+4, g+8, g+12 sits in one file (read by
    both steps and both DP ranks); each second turn in a file of its own."""
    rng = np.random.default_rng(0)
    writer = PayloadWriter(root)
    lengths = rng.integers(12, 40, SAMPLES)
    prompts = [int(n) // 2 for n in lengths]
    group_of = [i % GROUPS for i in range(SAMPLES)]
    groups = []
    for g in sorted(set(group_of)):
        members = [i for i in range(SAMPLES) if group_of[i] == g]
        rows = [
            rng.integers(0, EXPERTS, (prompts[i], LAYERS, TOPK)).astype(np.uint8) for i in members
        ]
        (segment,) = writer.write(0, {"routed_experts": np.concatenate(rows)})
        groups.append((segment, members, [r.shape[0] for r in rows]))
    samples, last_step = [], {}
    for i, n in enumerate(int(x) for x in lengths):
        segment, members, sizes = groups[group_of[i]]
        start = sum(sizes[: members.index(i)])
        first = shift([segment.clipped(start, start + prompts[i])], -start)[0]
        rows = rng.integers(0, EXPERTS, (n - 1 - prompts[i], LAYERS, TOPK)).astype(np.uint8)
        (second,) = writer.write(0, {"routed_experts": rows}, pos=prompts[i])
        requests = [
            {"prompt_len": prompts[i], "completion_len": 1, "sources": [first.to_dict()]},
            {
                "prompt_len": prompts[i] + 1,
                "completion_len": n - prompts[i] - 1,
                "sources": [second.to_dict()],
            },
        ]
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": requests})
        step = i // dp_worker.BATCH_SIZE
        for name in (first.file, second.file):
            last_step[name] = max(step, last_step.get(name, 0))
    return samples, last_step


def run_ranks(tmp_path) -> tuple[dict[int, dict], tuple[int, int]]:
    roots = [str(tmp_path / name) for name in ("uninterrupted", "resumed", "stream")]
    samples, last_step = write_samples(roots[0])
    shutil.copytree(roots[0], roots[1])
    stream = write_samples(roots[2])  # files shared across steps: the backstop's to delete
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps((roots, samples, last_step, stream)))
    args = (WORLD, str(tmp_path / "store"), str(job))
    reports = spawn_ranks(dp_worker.run, WORLD, args, DEADLINE_S)
    return reports, (len(last_step), len(stream[1]))


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 30)
def test_dp2_cp2_ranks_resume_to_the_same_bytes_and_share_one_root_safely(tmp_path):
    reports, (files, stream_files) = run_ranks(tmp_path)
    for rank, report in reports.items():
        # a checkpoint after step 0 and a resume of every rank: the same micro-batches, bytes
        assert report["resumed"] == report["whole"], rank
        assert {r[0] for r in report["whole"]} == {0, 1}
        assert all(tokens <= dp_worker.MAX_TOKENS for *_, tokens, _ in report["whole"])
    by_coords = {r["coords"]: r["whole"] for r in reports.values()}
    for step in (0, 1):
        shares = []
        for dp in range(dp_worker.DP):
            cp_views = [
                [r for r in by_coords[(dp, cp)] if r[0] == step] for cp in range(dp_worker.CP)
            ]
            ids = [[r[3] for r in view] for view in cp_views]
            assert ids[0] == ids[1]  # the CP ranks of a DP rank read the same samples
            assert len({len(view) for view in cp_views}) == 1
            shares.append([sid for micro in ids[0] for sid in micro])
        counts = {
            len([r for r in by_coords[(dp, 0)] if r[0] == step]) for dp in range(dp_worker.DP)
        }
        assert len(counts) == 1  # as many micro-batches on every DP rank
        every = sorted(sid for share in shares for sid in share)
        first = step * dp_worker.BATCH_SIZE
        assert every == sorted(f"s{i}" for i in range(first, first + dp_worker.BATCH_SIZE))
    deleter = reports[0]
    # every file deleted once in each run: up front claims (a list), and a stream's by the
    # backstop after its last step, protected till then by the claims the other ranks send
    assert deleter["deleted"] == (files, files, stream_files)
    assert all(r["deleted"] == (0, 0, 0) for rank, r in reports.items() if rank)
    assert deleter["left"] == [0, 0, 0]
    streamed = sorted(sid for r in reports.values() if r["coords"][1] == 0 for sid in r["stream"])
    assert streamed == sorted(f"s{i}" for i in range(SAMPLES))
