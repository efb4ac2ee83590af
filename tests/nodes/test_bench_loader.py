"""Smoke test: the end-to-end loader benchmark runs small and reports every target."""

from __future__ import annotations

import json

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark


def test_bench_loader_quick(tmp_path):
    out = tmp_path / "loader.json"
    report = load_benchmark(CHECKOUT_BENCHMARKS / "bench_loader.py").main(
        ["--quick", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert set(report["met"]) == set(report["targets"])
    assert report["route_bytes"] > 0
    assert {"loader", "loader_latency", "loader_first", "naive", "floor", "memcpy"} <= set(
        report["seconds"]
    )
    assert report["fixed_cost_us"]["loader_inline"] > 0
