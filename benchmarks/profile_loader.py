"""Where the loader's time goes: ``bench_loader.py``'s RL step, stage by stage.

The step is ``bench_loader.py``'s (built by its own builder): ``--rollouts`` Qwen3-30B-A3B
rollouts, half inline as vLLM and prime-rl bodies, half by handle, one batch of all of them. It
runs as ``r3data.loader`` prepares a micro-batch (every sample through
:class:`~r3data.nodes.stitcher.StitchRollout`, then one
:class:`~r3data.nodes.collate.CollateRollouts` call, both built as the loader builds them) in
steady state: buffers from a warm ``BufferPool``, each batch dropped before the next, page
cache warm. Interleaved with it (``step``, no clocks inside), the same step runs with a clock
around each stage, the rows of the stage table in ``docs/benchmarks.md``:

- ``stitch``: every sample normalised (its producer's bodies decoded) and stitched;
- ``size_checks``: the by-handle claims checked against their files, kept open for the reads;
- ``plan_and_jobs``: every piece placed at its batch rows (``plan``), the buffer taken from the
  pool (``allocate``), the fill's jobs built (``jobs``);
- ``fill``: the jobs run on the shared pool (decodes, reads, checksums, screening as bytes land);
- ``small_pieces_rest``: rows of another dtype converted and small pieces screened together
  (``small_pieces``), placeholders (``placeholders``), then all ``CollateRollouts`` does besides
  its fields: token ids, loss masks, statistics, metadata (``rest``).

Nothing in the library is patched: the collate stages are the steps of
:func:`r3data.nodes.fill.fill_field` called here in its order, and ``rest`` is the same
``CollateRollouts`` with no fields; its batch is checked equal to ``CollateRollouts``' own
before anything is timed, and the stages' sum is checked against ``step``. Best and median of
``--repeats``. Then a cProfile summary of one stitch and one collate, the top functions by
cumulative time: the calling thread only (the fill's lanes run on the shared pool, so in the
collate profile they are a wait), and cProfile slows Python code several times, so read its
shares, not its seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from r3data.batch import TensorBatch
from r3data.benchmarking import load_benchmark, parse_report_args, time_interleaved, write_report
from r3data.buffers import BufferPool
from r3data.nodes.collate import CollateRollouts
from r3data.nodes.fill import _LANE_BYTES, _FixedFill
from r3data.nodes.fill_common import FilledField, allocate, check_sizes
from r3data.nodes.options import CollateOptions, TraceOptions
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.stitcher import StitchedRollout, StitchRollout
from r3data.packed import PackedTensor
from r3data.parallel import pool_workers
from r3data.payload.reader import OpenFiles, PayloadReader, Plan
from r3data.synth import MODEL_SHAPES

bench_loader = load_benchmark(Path(__file__).parent / "bench_loader.py")

DEFAULT_OUT = Path(__file__).parent / "results" / "profile_loader.json"
ROOT = Path(__file__).resolve().parents[1]
STAGES = {
    "stitch": ("stitch",),
    "size_checks": ("size_checks",),
    "plan_and_jobs": ("plan", "allocate", "jobs"),
    "fill": ("fill",),
    "small_pieces_rest": ("small_pieces", "placeholders", "rest"),
}
"""The stage table's rows, each the clock's parts it sums."""
LABELS = {
    "stitch": "stitch",
    "size_checks": "collate: size checks",
    "plan_and_jobs": "collate: plan and jobs",
    "fill": "collate: fill",
    "small_pieces_rest": "collate: small pieces, rest",
}


class Clock:
    """Seconds per part of a run: each :meth:`lap` charges the time since the last to a part."""

    def __init__(self) -> None:
        self.seconds = {part: 0.0 for parts in STAGES.values() for part in parts}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now


def prepare_stages(root: str, pool: BufferPool) -> tuple[StitchRollout, CollateRollouts]:
    """The stitch and collate stages ``r3data.loader(payload_root=root, num_experts=...)``
    builds, with its defaults (one field, the routes; the pool's workers)."""
    trace, collate = TraceOptions(), CollateOptions()
    stitch = StitchRollout(collate.fields, trace)
    fill = CollateRollouts(
        collate.fields,
        PayloadReader(root),
        collate.pin_memory,
        pool_workers(),
        screen=ScreenOptions(num_experts=MODEL_SHAPES["qwen3-30b-a3b"].num_experts),
        on_gap=trace.on_gap,
        routes_field=trace.routes_field,
        pool=pool,
    )
    return stitch, fill


def step(stitch: StitchRollout, collate: CollateRollouts, items: list) -> TensorBatch:
    """One micro-batch as the loader prepares it: stitch every sample, then collate."""
    return collate([stitch(item, 0) for item in items])


def staged_step(
    stitch: StitchRollout, collate: CollateRollouts, items: list, clock: Clock
) -> tuple[dict[str, FilledField], TensorBatch]:
    """:func:`step` with each stage on ``clock``: its fields, and the rest of its batch."""
    rollouts = [stitch(item, 0) for item in items]
    clock.lap("stitch")
    fields = {name: staged_field(collate, name, rollouts, clock) for name in collate.fields}
    rest = dataclasses.replace(collate, fields=())(rollouts)
    clock.lap("rest")
    return fields, rest


def staged_field(
    collate: CollateRollouts, name: str, rollouts: Sequence[StitchedRollout], clock: Clock
) -> FilledField:
    """``fill_field`` of one fixed-width field as ``collate`` calls it, step by step."""
    kept = [r for r in rollouts if r.stitched is not None]
    stitched = [r.stitched[name] for r in kept]
    dtype = collate._dtype(name, stitched)
    screen = collate.screen if name == collate.routes_field else None
    fill = _FixedFill(name, stitched, stitched[0].row_shape, dtype, collate.reader, screen)
    handles = fill.plan()
    clock.lap("plan")
    opened = OpenFiles()
    if handles:
        check_sizes(collate.reader, fill.segments, handles, opened)
    clock.lap("size_checks")
    shape = (int(fill.offsets[-1]), *fill.row_shape)
    values = allocate(shape, dtype, name=name, pin_memory=collate.pin_memory, pool=collate.pool)
    fill.out = values.numpy()
    clock.lap("allocate")
    plan = Plan()
    jobs = fill.jobs(opened, plan.stop)
    clock.lap("jobs")
    lanes = min(collate.workers, max(1, fill.out.nbytes // _LANE_BYTES))
    plan.run(lambda i: jobs[i](), len(jobs), lanes)
    opened.close()
    clock.lap("fill")
    fill.convert_staged()
    fill.screen_small()
    clock.lap("small_pieces")
    ids = [r.sample.sample_id for r in kept]
    filled = fill.finish(stitched[0].topk, collate.on_gap, ids)
    filled.values = PackedTensor(values, fill.offsets)
    clock.lap("placeholders")
    return filled


def check_same(staged: tuple[dict[str, FilledField], TensorBatch], batch: TensorBatch) -> None:
    """The staged run's batch is ``CollateRollouts``' own (the stages are the loader's work)."""
    fields, rest = staged
    for name, filled in fields.items():
        theirs = batch[name]
        same = torch.equal(filled.values.values, theirs.values) and np.array_equal(
            filled.values.offsets, theirs.offsets
        )
        if not same or not np.array_equal(filled.valid, batch[f"{name}_valid"].values.numpy()):
            raise RuntimeError(f"the staged fill of {name!r} differs from CollateRollouts'")
    for name in ("token_ids", "loss_mask"):
        if not torch.equal(rest[name].values, batch[name].values):
            raise RuntimeError(f"the staged {name!r} differ from CollateRollouts'")


def summary(seconds: list[float]) -> dict[str, Any]:
    return {"best": min(seconds), "median": statistics.median(seconds), "runs": seconds}


def ratios(seconds: list[float], to: list[float]) -> dict[str, float]:
    """Best to best and median to median."""
    return {
        "best": min(seconds) / min(to),
        "median": statistics.median(seconds) / statistics.median(to),
    }


def profile(call: Callable[[], Any], top: int) -> tuple[dict[str, Any], Any]:
    """``call()`` under cProfile: its top ``top`` functions by cumulative time, and its result."""
    profiler = cProfile.Profile()
    profiler.enable()
    result = call()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats(pstats.SortKey.CUMULATIVE)
    rows = []
    ranked = [func for func in stats.fcn_list if func[0] != __file__]  # not the call itself
    for func in ranked[:top]:
        primitive, calls, tottime, cumtime, _ = stats.stats[func]
        rows.append(
            {
                "function": where(*func),
                "calls": calls,
                "primitive_calls": primitive,
                "tottime": tottime,
                "cumtime": cumtime,
            }
        )
    return {"seconds": stats.total_tt, "calls": stats.total_calls, "top": rows}, result


def where(file: str, line: int, name: str) -> str:
    """A function as pstats names it, its file shortened (the checkout's, a package's)."""
    if file == "~":  # a builtin
        return name
    path = Path(file)
    if path.is_relative_to(ROOT):
        path = path.relative_to(ROOT)
    elif "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1 :])
    else:
        path = Path(*path.parts[-2:])
    return f"{path}:{line}({name})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (each arm)")
    parser.add_argument("--top", type=int, default=20, help="functions in each profile")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parse_report_args(parser, argv, DEFAULT_OUT)
    if args.quick:
        args.rollouts, args.repeats, args.warmup, args.top = 16, 15, 1, 8
    with tempfile.TemporaryDirectory(prefix="r3data-profile-loader-") as root:
        samples, route_bytes, tokens = bench_loader._step(args, root)
        items = list(enumerate(samples))
        stitch, collate = prepare_stages(root, BufferPool())
        check_same(staged_step(stitch, collate, items, Clock()), step(stitch, collate, items))
        for _ in range(args.warmup):  # the pool's buffers faulted in, both arms' code warm
            step(stitch, collate, items)
            staged_step(stitch, collate, items, Clock())
        runs: list[dict[str, float]] = []

        def clocked() -> Any:
            clock = Clock()
            result = staged_step(stitch, collate, items, clock)
            runs.append(clock.seconds)
            return result

        seconds = time_interleaved(
            {"step": lambda: step(stitch, collate, items), "staged": clocked},
            args.repeats,
            freeze_heap=args.quick,
        )
        stitch_profile, rollouts = profile(lambda: [stitch(item, 0) for item in items], args.top)
        collate_profile, _ = profile(lambda: collate(rollouts), args.top)
    stages = {
        stage: {
            **summary([sum(run[part] for part in parts) for run in runs]),
            "parts": {part: summary([run[part] for run in runs]) for part in parts},
        }
        for stage, parts in STAGES.items()
    }
    sums = [sum(run.values()) for run in runs]
    report = {
        "benchmark": "profile_loader",
        "quick": args.quick,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "samples": len(samples),
        "route_bytes": route_bytes,
        "tokens": tokens,
        "workers": collate.workers,
        "step": summary(seconds["step"]),
        "staged": summary(seconds["staged"]),
        "stages": stages,
        "stages_sum": summary(sums),
        "stages_sum_vs_step": ratios(sums, seconds["step"]),
        "stages_sum_vs_staged": ratios(sums, seconds["staged"]),
        "profile": {"stitch": stitch_profile, "collate": collate_profile},
    }
    write_report(report, args.out)
    print_report(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    ms = 1e3
    print(
        f"step of {report['samples']} rollouts ({report['tokens']:,} tokens, "
        f"{report['route_bytes'] / 1e6:.0f} MB of routes), {report['workers']} fill workers, "
        f"pooled buffers; best and median of {report['config']['repeats']}, in ms:"
    )
    print(f"{'stage':<30} {'best':>8} {'median':>8}")
    for stage, row in report["stages"].items():
        print(f"{LABELS[stage]:<30} {row['best'] * ms:8.1f} {row['median'] * ms:8.1f}")
        for part, sub in row["parts"].items():
            if len(row["parts"]) > 1:
                print(f"  {part:<28} {sub['best'] * ms:8.1f} {sub['median'] * ms:8.1f}")
    for label, key in (("sum of the stages", "stages_sum"), ("step, no clocks", "step")):
        row = report[key]
        print(f"{label:<30} {row['best'] * ms:8.1f} {row['median'] * ms:8.1f}")
    to_step, covered = report["stages_sum_vs_step"], report["stages_sum_vs_staged"]
    print(
        f"check: the stages sum to {to_step['best']:.3f}x the step (best; medians "
        f"{to_step['median']:.3f}x); the clocks cover {covered['median']:.1%} of their own run"
    )
    for stage, prof in report["profile"].items():
        print(
            f"\ncProfile of one {stage} (calling thread; {prof['seconds'] * ms:.0f} ms profiled, "
            f"{prof['calls']:,} calls), top {len(prof['top'])} by cumulative time:"
        )
        print(f"{'cumtime ms':>10} {'tottime ms':>10} {'calls':>10}  function")
        for row in prof["top"]:
            print(
                f"{row['cumtime'] * ms:10.1f} {row['tottime'] * ms:10.1f} {row['calls']:>10}  "
                f"{row['function']}"
            )


if __name__ == "__main__":
    main()
