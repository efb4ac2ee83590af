"""``r3data bench``: run every benchmark, write JSON and plots, print ratios against targets.

Benchmarks are scripts in the repository's ``benchmarks/`` folder, not part of the installed
package: each ``bench_*.py`` runs in a fresh interpreter (one benchmark's heap, page cache and
huge pages never slow the next) with ``--out`` a temporary name next to
``<results>/bench_<name>.json`` (and ``--quick``); its report is read back from there and then
replaces that file, so a benchmark that fails leaves the report before it in place. Reports
state their targets as ``targets`` (name -> number) and ``met`` (name -> bool) next to the
measured values, at the top level or per entry of ``results``; a report whose ``targets`` are
booleans gives pass/fail only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from r3data.benchmarking import CHECKOUT_BENCHMARKS
from r3data.cli.bench_plots import write_plots
from r3data.cli.bench_report import SUMMARY, checks, table
from r3data.cli.common import EXIT_PROBLEMS, progress
from r3data.errors import ConfigError
from r3data.parallel import permitted_cpus


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="run every benchmark; write JSON and plots; print ratios against targets",
        description="Run each benchmarks/bench_*.py of a source checkout in its own process, "
        "write its JSON report and PNG plots (when matplotlib is installed) to the results "
        "folder, and print every measured ratio against its target. Exit code 1 when a "
        "benchmark fails or (full sizes only) misses a target.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke run of a few seconds each; its results go to a temporary "
        "folder (unless --results is given) and targets do not fail it",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these benchmarks (e.g. wire payload)"
    )
    parser.add_argument(
        "--benchmarks",
        type=Path,
        metavar="DIR",
        help="folder holding bench_*.py (default: the checkout's benchmarks/)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        metavar="DIR",
        help="where JSON and PNG files go (default: <benchmarks>/results)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.set_defaults(run=run)


def find_benchmarks(directory: Path | None) -> list[Path]:
    """``bench_*.py`` in ``directory``, or in the checkout r3data was installed from."""
    if directory is None:
        directory = CHECKOUT_BENCHMARKS
        if not directory.is_dir():
            raise ConfigError(
                f"no benchmarks folder at {directory}: r3data is not installed from a source "
                f"checkout; pass --benchmarks DIR"
            )
    if not directory.is_dir():
        raise ConfigError(f"--benchmarks {directory}: not a directory")
    scripts = sorted(directory.glob("bench_*.py"))
    if not scripts:
        raise ConfigError(f"{directory}: no bench_*.py scripts")
    return scripts


def bench_name(script: Path) -> str:
    return script.stem.removeprefix("bench_")


def machine() -> dict[str, Any]:
    """The machine the numbers were measured on."""
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(
                (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), ""
            )
    except OSError:
        pass
    memory = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "permitted_cpus": permitted_cpus(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


class BenchmarkFailed(Exception):
    """A benchmark script exited with an error (its last line of output is the message)."""


def run_benchmark(script: Path, out: Path, *, quick: bool) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter, its output passed on as it comes; its report,
    which then replaces ``out``. The script writes to a temporary name next to ``out``, so
    a benchmark that fails leaves the report before it in place (and never passes it for
    this run's)."""
    partial = out.with_name(f".{out.name}.partial")
    partial.unlink(missing_ok=True)
    argv = [sys.executable, str(script), "--out", str(partial)] + (["--quick"] if quick else [])
    last = ""
    try:
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as p:
            for line in p.stdout:  # type: ignore[union-attr]
                print(line, end="", flush=True)
                last = line.strip() or last
        if p.returncode != 0:
            raise BenchmarkFailed(last or f"exit code {p.returncode}")
        if not partial.exists():
            raise BenchmarkFailed(f"exit code 0 but no report written to --out {partial}")
        report = json.loads(partial.read_text())
        if not isinstance(report, dict):
            raise BenchmarkFailed(f"{out}: expected a JSON object, found a {type(report).__name__}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return report


def _kept_reports(results: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The reports of benchmarks ``names`` (not run now) already in ``results``, whose checks
    the summary keeps: a run of some benchmarks never drops the others' results."""
    kept = {}
    for name in names:
        try:
            report = json.loads((results / f"bench_{name}.json").read_text())
        except (OSError, ValueError):  # none there, or unreadable: nothing to keep
            continue
        if isinstance(report, dict):
            kept[name] = report
    return kept


def run(args: argparse.Namespace) -> int:
    scripts = find_benchmarks(args.benchmarks)
    skipped: list[str] = []
    if args.only:
        unknown = sorted(set(args.only) - {bench_name(s) for s in scripts})
        if unknown:
            raise ConfigError(
                f"--only: no benchmark named {unknown}; found {[bench_name(s) for s in scripts]}"
            )
        skipped = [bench_name(s) for s in scripts if bench_name(s) not in args.only]
        scripts = [s for s in scripts if bench_name(s) in args.only]
    if args.results is not None:
        results = args.results
    elif args.quick:  # a smoke run never overwrites the committed full-size results
        results = Path(tempfile.mkdtemp(prefix="r3data-bench-quick-"))
    else:
        results = scripts[0].parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    reports: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for script in progress(scripts, "bench", len(scripts)):
        name = bench_name(script)
        print(f"== {name}", flush=True)
        out = results / f"bench_{name}.json"
        try:
            reports[name] = run_benchmark(script, out, quick=args.quick)
        except (OSError, ValueError, BenchmarkFailed) as exc:  # the others' results still count
            errors[name] = str(exc)
            print(f"r3data bench: {name} failed: {errors[name]}", file=sys.stderr)
    found = [c for name, report in reports.items() for c in checks(name, report)]
    kept = _kept_reports(results, skipped)
    every = found + [c for name, report in kept.items() for c in checks(name, report)]
    summary = {
        "quick": args.quick,
        "machine": machine(),
        "checks": [asdict(c) for c in every],
        "errors": errors,
        "kept": sorted(kept),
    }
    (results / f"{SUMMARY}.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots = [] if args.no_plots else write_plots(reports, every, results)
    print()
    print(table(found))
    for name, message in errors.items():
        print(f"{name}: FAILED: {message}")
    if kept:
        print(f"summary: checks kept from the reports already there: {', '.join(sorted(kept))}")
    print(f"results in {results}" + (f" ({len(plots)} plots)" if plots else ""))
    missed = not args.quick and not all(c.met for c in found)
    return EXIT_PROBLEMS if errors or missed else 0
