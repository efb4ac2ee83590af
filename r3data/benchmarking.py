"""Measurement helpers shared by the scripts in ``benchmarks/`` and ``r3data bench``.

Arms of one benchmark run interleaved (a, b, c, a, b, c, ...) so that load from elsewhere on a
shared machine hits every arm alike; ratios are taken between arms of the same run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


def time_interleaved(
    cases: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    sync: Callable[[], None] | None = None,
    freeze_heap: bool = False,
) -> dict[str, list[float]]:
    """Seconds of each case, ``repeats`` times, cases interleaved, each run after a collection
    (what the runs before it left is freed); ``sync`` (e.g. ``torch.cuda.synchronize``) runs
    before the clock starts and before it stops. With ``freeze_heap`` (a ``--quick`` smoke run)
    what lived before the first run is left out of every collection: cheap in a large process
    such as a test suite, but not the heap a trainer's collections walk. A heap the caller
    froze already is left as it is (``gc.unfreeze`` would give back the caller's part too)."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    freeze_heap = freeze_heap and gc.get_freeze_count() == 0
    if freeze_heap:
        gc.collect()
        gc.freeze()
    try:
        for _ in range(repeats):
            for name, call in cases.items():
                gc.collect()
                if sync is not None:
                    sync()
                start = time.perf_counter()
                result = call()
                if sync is not None:
                    sync()
                seconds[name].append(time.perf_counter() - start)
                del result
    finally:
        if freeze_heap:
            gc.unfreeze()
    return seconds


def traced_peak_bytes(call: Callable[[], Any]) -> int:
    """Peak Python-traced allocation while ``call`` runs (numpy buffers included)."""
    gc.collect()
    tracemalloc.start()
    try:
        result = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return peak


def write_report(report: dict[str, Any], out: Path) -> None:
    """Write a benchmark's report as JSON (the folder is created)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")


def report_path(out: Path | None, quick: bool, default: Path) -> Path:
    """Where a benchmark writes its report: ``out`` when given, else ``default`` (the committed
    results); a ``--quick`` smoke run goes to a new temporary folder instead, so that it never
    replaces full-size results with ratios that mean nothing."""
    if out is not None:
        return out
    if quick:
        return Path(tempfile.mkdtemp(prefix="r3data-bench-quick-")) / default.name
    return default


def parse_report_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, default: Path
) -> argparse.Namespace:
    """Parse a benchmark's command line (its own options and ``--quick``) with the ``--out``
    every benchmark takes, resolved by :func:`report_path`."""
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: benchmarks/results/; --quick: a temporary folder)",
    )
    args = parser.parse_args(argv)
    args.out = report_path(args.out, args.quick, default)
    return args


CHECKOUT_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
"""``benchmarks/`` of the source checkout r3data is installed from (editable installs)."""


def load_benchmark(script: Path) -> ModuleType:
    """Import a benchmark script by path (``benchmarks/`` is not a package)."""
    name = f"r3data_benchmarks_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module
