"""``r3data demo``: one RL step on synthetic rollouts, with a summary table."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator

from r3data.cli.common import count, format_bytes, int_at_least, progress, render_table
from r3data.synth import INLINE_PRODUCERS, MODEL_SHAPES, StepReport, play_step
from r3data.synth.step import GRID

DEFAULT_SHAPE = "qwen3-30b-a3b"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="play one RL step on synthetic rollouts (no network, under a minute)",
        description="Play one RL step: synthesise multi-turn rollouts for a model shape, serve "
        "half inline (raw producer responses, spliced) and half by handle (payload files under "
        "a temporary root), stream them through r3data.loader, check every route row against "
        "the engine's, expand each micro-batch for every rank of a TP 2 x CP 2 layout with "
        "sequence parallelism and, when megatron-core is installed, replay rank tp0 cp0's "
        "routes through real Megatron TopKRouters on the CPU. Retention deletes every payload "
        "file once the step is trained. Exit code 1 when a check fails.",
    )
    parser.add_argument(
        "--rollouts", type=int_at_least(1), default=64, help="rollouts in the step (default 64)"
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=DEFAULT_SHAPE,
        help=f"layers, experts and top-k of a public MoE model (default {DEFAULT_SHAPE})",
    )
    parser.add_argument(
        "--micro-batches",
        type=int_at_least(1),
        default=4,
        help="micro-batches the step's batch is split into, ceil(rollouts / M) rollouts each "
        "(fewer where the rollouts run out first; default 4)",
    )
    parser.add_argument(
        "--max-turns",
        type=int_at_least(1),
        default=3,
        help="turns per rollout, at most (default 3)",
    )
    parser.add_argument(
        "--max-len",
        type=int_at_least(2),
        default=16384,
        help="tokens per rollout, at most (default 16384)",
    )
    parser.add_argument(
        "--producers",
        nargs="+",
        choices=INLINE_PRODUCERS,
        default=["vllm", "prime-rl"],
        help="formats of the inline responses, used in turn (default: vllm prime-rl)",
    )
    parser.add_argument(
        "--engine-bugs",
        type=int_at_least(0),
        default=1,
        help="inline multi-turn rollouts whose last response has all-zero routes, a known "
        "engine bug that must never be replayed (default 1)",
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="random seed (default 0)")
    parser.add_argument(
        "--workers", type=int_at_least(1), help="loader threads (default: the permitted CPUs)"
    )
    parser.add_argument("--no-replay", action="store_true", help="skip the Megatron replay check")
    parser.add_argument(
        "--verbose", action="store_true", help="show r3data's warnings (dropped routes, gaps)"
    )
    parser.set_defaults(run=run)


@contextlib.contextmanager
def _library_warnings(shown: bool) -> Iterator[None]:
    """r3data's logged warnings on stderr when ``shown`` (the demo's engine bug is expected,
    so they are off by default); never megatron-core's notice that Transformer Engine and
    Apex are missing (the demo replays on the CPU without them, on purpose)."""
    logger = logging.getLogger("r3data")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("r3data: %(levelname)s: %(message)s"))
    if shown:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed")
            yield
    finally:
        logger.removeHandler(handler)


def run(args: argparse.Namespace) -> int:
    shape = MODEL_SHAPES[args.model_shape]
    with (
        tempfile.TemporaryDirectory(prefix="r3data-demo-") as tmp,
        _library_warnings(args.verbose),
    ):
        report = play_step(
            shape,
            os.path.join(tmp, "payloads"),
            rollouts=args.rollouts,
            micro_batches=args.micro_batches,
            seed=args.seed,
            max_turns=args.max_turns,
            max_len=args.max_len,
            producers=args.producers,
            engine_bugs=args.engine_bugs,
            workers=args.workers,
            replay=not args.no_replay,
            progress=progress,
        )
    print(summary(report))
    return 0 if report.ok and report.replay.status != "failed" else 1


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def _verdict(problems: tuple[str, ...], good: str) -> str:
    return good if not problems else f"{count(len(problems), 'PROBLEM')} (listed below)"


def summary(report: StepReport) -> str:
    """The demo's closing table, then the replay verdict on its own line."""
    shape, served, stats = report.shape, report.served, report.stats
    routes = served.inline_route_bytes + served.handle_route_bytes
    saved = report.padded_bytes - report.packed_bytes
    seconds = max(report.load_seconds, 1e-9)
    local = sum(r.local_tokens for r in report.ranks)
    padding = sum(r.padding_tokens for r in report.ranks)
    grid = f"TP {GRID['tp_size']} x CP {GRID['cp_size']}, SP"
    rows = [
        (
            "rollouts",
            f"{report.rollouts} ({served.inline_rollouts} inline, {served.handle_rollouts} by "
            f"handle), {count(report.requests, 'request')}",
        ),
        ("tokens", f"{report.tokens:,}"),
        (
            "route bytes inline",
            f"{format_bytes(served.inline_route_bytes)} "
            f"(in {format_bytes(served.inline_body_bytes)} of response bodies)",
        ),
        (
            "route bytes by handle",
            f"{format_bytes(served.handle_route_bytes)} in "
            f"{count(len(served.files), 'payload file')}",
        ),
        (
            "packed vs padded",
            f"{format_bytes(report.packed_bytes)} packed vs "
            f"{format_bytes(report.padded_bytes)} as a padded rectangle: "
            f"{format_bytes(saved)} saved ({_percent(saved, report.padded_bytes)})",
        ),
        (
            "throughput",
            f"{report.tokens / seconds:,.0f} tokens/s, {format_bytes(routes / seconds)}/s of "
            f"routes ({report.load_seconds:.2f} s to load the step's batch)",
        ),
        (
            "placeholders and gaps",
            f"{count(stats.placeholders, 'placeholder row')}, {count(stats.gaps, 'gap')}: "
            f"{count(stats.rows_missing, 'all-zero engine row')} in "
            f"{count(len(served.zero_route_rollouts), 'rollout')}, "
            f"{count(stats.rows_dropped, 'good row')} dropped with them; none replayed",
        ),
        (
            "routes checked",
            f"{report.rows_checked:,} rows against the engine's: "
            + _verdict(report.mismatches, "all equal"),
        ),
        (
            f"layout ({grid})",
            f"{count(report.micro_batches, 'micro-batch', 'micro-batches')}, "
            f"{local // max(len(report.ranks), 1):,} tokens per rank "
            f"({_percent(padding, local)} padding): "
            + _verdict(report.layout_errors, "every token on exactly one rank"),
        ),
        (
            "retention",
            f"{count(len(served.files), 'file')} written, {report.files_deleted} deleted "
            f"({format_bytes(report.bytes_deleted)}), {report.files_left} left",
        ),
    ]
    lines = [
        f"r3data demo: one RL step of {shape.name} ({shape.num_layers} layers, "
        f"{shape.num_experts} experts, top-{shape.topk})",
        render_table(rows),
    ]
    lines += [f"  ! {problem}" for problem in (*report.mismatches, *report.layout_errors)[:10]]
    verdict = "replay verified" if report.replay.status == "verified" else "replay not verified"
    lines.append(f"{verdict}: {report.replay.detail}")
    return "\n".join(lines)
