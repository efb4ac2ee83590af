"""``r3data bench``: real benchmarks run small, their targets tabled, JSON and plots written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from r3data.cli import main
from r3data.cli.bench_report import Check, checks, table

QUICK = ["wire", "expand"]  # the fastest, and both report schemas


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    code = main(["bench", "--quick", "--only", *QUICK, "--results", str(results)])
    return code, results


def test_every_target_of_every_benchmark_is_tabled_as_its_report_states(quick_run):
    code, results = quick_run
    summary = json.loads((results / "summary.json").read_text())
    assert summary["errors"] == {}
    assert summary["quick"] is True
    assert summary["machine"]["permitted_cpus"] >= 1
    found = {(c["benchmark"], c["name"]): c for c in summary["checks"]}
    expected = 0
    for name in QUICK:
        report = json.loads((results / f"bench_{name}.json").read_text())
        entries = [("", report)] + [(f"{r['layout']}: ", r) for r in report.get("results", [])]
        for prefix, entry in entries:
            flags = entry.get("met")  # a report may also sum up its entries with one bool
            for key, met in (flags if isinstance(flags, dict) else {}).items():
                check = found[(name, prefix + key)]
                assert check["met"] == met
                assert check["value"] == pytest.approx(entry[key])
                assert check["target"] == pytest.approx(report["targets"][key])
                expected += 1
    assert len(found) == expected > 0
    assert code == 0  # a quick run is a smoke run: missed targets do not fail it


def test_a_quick_run_leaves_the_committed_results_alone(monkeypatch, capsys):
    """Without --results, --quick writes to a temporary folder, never benchmarks/results;
    --no-plots writes JSON only."""
    from r3data.benchmarking import CHECKOUT_BENCHMARKS

    committed = CHECKOUT_BENCHMARKS / "results" / "bench_wire.json"
    before = committed.read_bytes() if committed.exists() else None
    assert main(["bench", "--quick", "--only", "wire", "--no-plots"]) == 0
    after = committed.read_bytes() if committed.exists() else None
    assert after == before
    out = capsys.readouterr().out
    assert "results in " in out
    written = Path(out.split("results in ")[-1].split()[0])
    assert written != CHECKOUT_BENCHMARKS / "results"
    assert sorted(p.name for p in written.iterdir()) == ["bench_wire.json", "summary.json"]
    shutil.rmtree(written)  # the user's to read and remove; a test run leaves nothing behind
    assert "benchmark  check" in out
    assert "wire" in out.split("benchmark  check", 1)[1]


def test_a_quick_script_run_directly_leaves_the_committed_results_alone(monkeypatch, tmp_path):
    """``python benchmarks/bench_wire.py --quick`` writes its report to a temporary folder."""
    import tempfile

    from r3data.benchmarking import CHECKOUT_BENCHMARKS, load_benchmark, report_path

    committed = CHECKOUT_BENCHMARKS / "results" / "bench_wire.json"
    before = committed.read_bytes() if committed.exists() else None
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = load_benchmark(CHECKOUT_BENCHMARKS / "bench_wire.py").main(["--quick"])
    assert (committed.read_bytes() if committed.exists() else None) == before
    (written,) = tmp_path.glob("r3data-bench-quick-*/bench_wire.json")
    assert json.loads(written.read_text())["met"] == report["met"]
    assert report_path(None, False, committed) == committed  # a full run: the committed one
    assert report_path(committed, True, committed) == committed  # --out given wins


def test_the_expand_report_holds_every_layout_and_arm(quick_run):
    _, results = quick_run
    result = json.loads((results / "bench_expand.json").read_text())
    assert [r["layout"] for r in result["results"]] == ["thd tp2 cp2 sp", "bshd tp2 cp2 sp"]
    config = result["config"]
    assert result["results"][1]["micro_batches"] == -(
        -config["sequences"] // config["bshd_micro_batch"]
    )
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


def test_plots_are_written_for_each_benchmark_and_the_margins(quick_run):
    _, results = quick_run
    for name in [*[f"bench_{n}" for n in QUICK], "summary"]:
        assert (results / f"{name}.png").read_bytes().startswith(b"\x89PNG")


def test_targets_read_from_values_and_met_flags():
    report = {
        "speedup": 8.0,
        "ratio": 2.0,
        "targets": {"speedup": 6.0, "ratio": 1.5},
        "met": {"speedup": True, "ratio": False},
        "results": [{"layout": "thd", "peak": 0.5, "met": {"peak": True}}],
    }
    report["targets"]["peak"] = 1.2
    found = checks("demo", report)
    assert found == [
        Check("demo", "speedup", 8.0, 6.0, ">=", True),
        Check("demo", "ratio", 2.0, 1.5, "<=", False),
        Check("demo", "thd: peak", 0.5, 1.2, "<=", True),
    ]
    assert [c.margin for c in found] == [
        pytest.approx(8 / 6),
        pytest.approx(0.75),
        pytest.approx(2.4),
    ]
    flags_only = checks("old", {"targets": {"bytes_equal": True, "faster": False}})
    assert [(c.name, c.value, c.met) for c in flags_only] == [
        ("bytes_equal", None, True),
        ("faster", None, False),
    ]


def test_times_are_tabled_in_microseconds_and_ratios_as_ratios():
    report = {
        "fixed_cost_us_inline": 109.4,
        "ratio": 2.0,
        "targets": {"fixed_cost_us_inline": 50.0, "ratio": 1.5},
        "met": {"fixed_cost_us_inline": False, "ratio": False},
    }
    lines = table(checks("loader", report)).splitlines()
    assert lines[2].split()[2:] == ["109.40", "us", "<=", "50", "us", "NO"]
    assert lines[3].split()[2:] == ["2.00x", "<=", "1.5x", "NO"]


def run_scripts(tmp_path: Path, capsys, scripts: dict[str, str]):
    """``r3data bench`` over ``bench_<name>.py`` scripts of these texts: exit code, stdout,
    stderr, the summary and the results folder."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    for name, text in scripts.items():
        (folder / f"bench_{name}.py").write_text(text)
    results = tmp_path / "results"
    code = main(["bench", "--benchmarks", str(folder), "--results", str(results), "--no-plots"])
    out, err = capsys.readouterr()
    return code, out, err, json.loads((results / "summary.json").read_text()), results


def test_each_benchmark_runs_in_its_own_process_and_a_failure_is_reported(tmp_path, capsys):
    """A benchmark that raises is named with its last line, and the others' reports count."""
    pid = (
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "report = {'pid': os.getpid(), 'x': 2.0, 'targets': {'x': 1.0}, 'met': {'x': True}}\n"
        "open(out, 'w').write(json.dumps(report))\n"
        "print('measured', flush=True)\n"
    )
    scripts = {"broken": "raise SystemExit('broken: no such device')\n", "pid": pid}
    code, out, err, summary, results = run_scripts(tmp_path, capsys, scripts)
    assert code == 1
    assert "broken: FAILED: broken: no such device" in out
    assert "r3data bench: broken failed: broken: no such device" in err
    assert "measured" in out
    assert summary["errors"] == {"broken": "broken: no such device"}
    assert json.loads((results / "bench_pid.json").read_text())["pid"] != os.getpid()


def test_a_report_that_is_no_json_object_fails_that_benchmark_only(tmp_path, capsys):
    """A script writing a JSON list ended the run with an AttributeError traceback."""
    writes = "import sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write({!r})\n"
    scripts = {"list": writes.format("[1, 2]"), "ok": writes.format('{"x": 2.0, "met": {"x": 1}}')}
    code, out, err, summary, _ = run_scripts(tmp_path, capsys, scripts)
    assert code == 1
    assert "list: FAILED: " in out
    assert "expected a JSON object, found a list" in err
    assert [c["name"] for c in summary["checks"]] == ["x"]


def test_a_run_of_some_benchmarks_keeps_the_others_checks_in_the_summary(tmp_path, capsys):
    """``--only wire`` into the committed results rewrote summary.json and summary.png with
    wire's checks alone, though every other benchmark's report was still there."""
    writes = "import sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write({!r})\n"
    scripts = {
        "new": writes.format('{"x": 0.5, "targets": {"x": 1.0}, "met": {"x": false}}'),
        "old": writes.format('{"y": 3.0, "targets": {"y": 1.0}, "met": {"y": true}}'),
    }
    code, *_ = run_scripts(tmp_path, capsys, scripts)
    assert code == 1
    folder, results = tmp_path / "benchmarks", tmp_path / "results"
    (folder / "bench_new.py").write_text(writes.format('{"x": 2.0, "met": {"x": true}}'))
    argv = ["bench", "--benchmarks", str(folder), "--results", str(results), "--no-plots"]
    assert main([*argv, "--only", "new"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((results / "summary.json").read_text())
    assert [(c["benchmark"], c["value"]) for c in summary["checks"]] == [("new", 2.0), ("old", 3.0)]
    assert summary["kept"] == ["old"]
    assert "kept from the reports already there: old" in out


def test_a_benchmark_that_fails_leaves_the_report_before_it_in_place(tmp_path, capsys):
    """The report was deleted before the script ran, so a crash mid-run (a full run killed
    for memory, say) lost the committed one; a report that fails to read back did too."""
    writes = "import sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write({!r})\n"
    good = '{"x": 2.0, "met": {"x": true}}'
    code, *_, results = run_scripts(tmp_path, capsys, {"flaky": writes.format(good)})
    assert code == 0
    before = (results / "bench_flaky.json").read_bytes()
    folder = tmp_path / "benchmarks"
    argv = ["bench", "--benchmarks", str(folder), "--results", str(results), "--no-plots"]
    for broken in (writes.format('{"x": 2.0') + "raise SystemExit('killed')\n", writes.format("{")):
        (folder / "bench_flaky.py").write_text(broken)
        assert main(argv) == 1
        assert "flaky: FAILED: " in capsys.readouterr().out
        assert (results / "bench_flaky.json").read_bytes() == before
        assert sorted(p.name for p in results.iterdir()) == ["bench_flaky.json", "summary.json"]
