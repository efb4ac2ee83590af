"""Smoke test: the expand benchmark runs on a tiny batch and writes its JSON report."""

from __future__ import annotations

import json

from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark

BENCH = CHECKOUT_BENCHMARKS / "bench_expand.py"


def test_bench_expand_quick(tmp_path):
    bench = load_benchmark(BENCH)
    out = tmp_path / "expand.json"
    result = bench.main(
        ["--quick", "--sequences", "4", "--micro-batch", "2", "--repeats", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert [r["layout"] for r in result["results"]] == ["thd tp2 cp2 sp", "bshd tp2 cp2 sp"]
    assert result["results"][1]["micro_batches"] == 2
    for r in result["results"]:
        assert set(r["seconds_median"]) == {
            "widen",
            "widen_threads",
            "clone",
            "copy_into",
            "expand",
            "numpy_copy",
        }
        assert r["numpy_copy_throughput_ratio"] > 0
        assert r["output_bytes"] == r["local_tokens"] * 48 * 8 * 4
        assert r["widen_throughput_ratio"] > 0
        assert r["widen_threads_throughput_ratio"] > 0
        assert r["widen_threads"] >= 1
        assert set(r["met"]) == set(result["targets"])
    assert isinstance(result["met"], bool)
    assert "transparent_hugepage" in result["config"]
