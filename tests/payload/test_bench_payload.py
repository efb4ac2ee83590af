"""Smoke test: the payload benchmark runs on tiny sizes and writes its JSON."""

from __future__ import annotations

import json

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark

BENCH = CHECKOUT_BENCHMARKS / "bench_payload.py"


def test_bench_payload_quick(tmp_path):
    bench = load_benchmark(BENCH)
    out = tmp_path / "bench_payload.json"
    argv = ["--quick", "--files", "8", "--total-mb", "0.5", "--latency-ms", "1", "--out", str(out)]
    result = bench.main([*argv, "--repeats", "1"])
    assert json.loads(out.read_text()) == result
    assert set(result) >= {
        "config",
        "seconds_best",
        "seconds_median",
        "ratio_to_floor",
        "ratio_to_floor_no_checksum",
        "concurrency_speedup",
        "targets",
        "met",
    }
    assert set(result["seconds_best"]) == {
        "ours",
        "ours_no_checksum",
        "floor",
        "latency_serial",
        "latency_concurrent",
    }
    assert result["config"]["files"] == 8
    assert all(value > 0 for value in result["seconds_best"].values())
