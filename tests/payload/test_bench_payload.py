"""Smoke test: the payload benchmark runs on tiny sizes and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_payload.py"


def test_bench_payload_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_payload", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
