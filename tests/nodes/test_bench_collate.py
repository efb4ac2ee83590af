"""Smoke test: the collate benchmark runs at tiny sizes and writes its JSON report."""

from __future__ import annotations

import json

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark


def test_bench_collate_quick(tmp_path):
    bench = load_benchmark(CHECKOUT_BENCHMARKS / "bench_collate.py")
    out = tmp_path / "collate.json"
    report = bench.main(["--quick", "--out", str(out)])  # 32 sequences of at most 512 rows
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert set(report["distributions"]) == {"uniform", "mild", "typical_rl", "heavy_tail"}
    typical = report["distributions"]["typical_rl"]
    assert typical["bytes"]["packed"] == typical["bytes"]["real_rows"]
    assert typical["bytes"]["padded"] == 32 * 512 * 48 * 8
    assert set(report["met"]) == set(report["targets"])
    assert report["met"]["packed_bytes_vs_real"]
