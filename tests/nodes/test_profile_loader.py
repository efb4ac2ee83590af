"""Smoke test: the loader's stage profile runs small, times every stage, and its stages add up
to the step; the staged run is refused when its batch is not the loader's."""

from __future__ import annotations

import argparse
import json

import pytest

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark
from r3data.buffers import BufferPool

STAGES = {"stitch", "size_checks", "plan_and_jobs", "fill", "small_pieces_rest"}


@pytest.fixture(scope="module")
def profile_loader():
    return load_benchmark(CHECKOUT_BENCHMARKS / "profile_loader.py")


def test_profile_loader_quick(profile_loader, tmp_path):
    out = tmp_path / "profile.json"
    report = profile_loader.main(["--quick", "--out", str(out)])  # 16 rollouts, 15 repeats
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert set(report["stages"]) == STAGES
    for stage in report["stages"].values():
        assert len(stage["runs"]) == 15
        assert 0 < stage["best"] <= stage["median"]
        assert sum(part["median"] for part in stage["parts"].values()) > 0
    sums = [sum(stage["runs"][i] for stage in report["stages"].values()) for i in range(15)]
    assert sums == pytest.approx(report["stages_sum"]["runs"])
    # every clocked second lies inside its own run, and nearly all of the run is clocked
    assert 0.9 < report["stages_sum_vs_staged"]["median"] <= 1.0
    # best against best: load from elsewhere on the machine only ever slows a run
    assert report["stages_sum_vs_step"]["best"] == pytest.approx(1.0, abs=0.25)
    stitch, collate = (report["profile"][stage]["top"] for stage in ("stitch", "collate"))
    assert len(stitch) == len(collate) == 8
    assert any("stitcher.py" in row["function"] for row in stitch)
    assert any("collate.py" in row["function"] for row in collate)
    assert all(row["cumtime"] >= row["tottime"] >= 0 for row in stitch + collate)


def test_a_staged_batch_that_differs_from_the_loaders_is_refused(profile_loader, tmp_path):
    samples, _, _ = profile_loader.bench_loader._step(argparse.Namespace(rollouts=4), tmp_path)
    items = list(enumerate(samples))
    stitch, collate = profile_loader.prepare_stages(str(tmp_path), BufferPool())
    staged = profile_loader.staged_step(stitch, collate, items, profile_loader.Clock())
    batch = profile_loader.step(stitch, collate, items)
    profile_loader.check_same(staged, batch)
    batch["routed_experts"].values[-1] += 1
    with pytest.raises(RuntimeError, match="routed_experts"):
        profile_loader.check_same(staged, batch)
