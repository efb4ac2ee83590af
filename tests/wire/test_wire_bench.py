"""Smoke test: the wire benchmark runs on a tiny body and writes its JSON report."""

from __future__ import annotations

import json

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark

BENCH = CHECKOUT_BENCHMARKS / "bench_wire.py"


def test_bench_wire_quick(tmp_path):
    bench = load_benchmark(BENCH)
    out = tmp_path / "wire.json"
    result = bench.main(
        ["--quick", "--choices", "2", "--tokens", "32", "--repeats", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert set(result["seconds_best"]) == {
        "naive",
        "naive_stdlib",
        "floor",
        "ours",
        "ours_two_fields",
    }
    for key in ("speedup_vs_naive", "ratio_to_floor", "second_field_ratio", "peak_extra_ratio"):
        assert result[key] > 0
    assert result["decoded_bytes"] == 2 * 32 * 48 * 8
    assert set(result["met"]) == set(result["targets"])
