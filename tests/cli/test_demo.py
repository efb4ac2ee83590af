"""``r3data demo`` and the step behind it, end to end, with megatron-core's routers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from r3data.cli import main
from r3data.cli.demo import summary
from r3data.errors import ConfigError
from r3data.synth import MODEL_SHAPES, play_step

MEGATRON = importlib.util.find_spec("megatron") is not None


def test_demo_prints_the_summary_and_the_replay_verdict(capsys):
    assert main(["demo", "--rollouts", "4", "--max-len", "1024", "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out
    for row in (
        "rollouts",
        "route bytes inline",
        "route bytes by handle",
        "packed vs padded",
        "throughput",
        "placeholders and gaps",
        "routes checked",
        "layout",
        "retention",
    ):
        assert f"\n{row}" in out
    assert "4 (2 inline, 2 by handle)" in out
    assert "all equal" in out
    assert "every token on exactly one rank" in out
    assert ", 0 left" in out
    verdict = out.strip().splitlines()[-1]
    if MEGATRON:
        assert verdict.startswith("replay verified: ")
    else:
        assert verdict.startswith("replay not verified: megatron-core is not installed")


def test_demo_serves_sglang_and_skyrl_and_may_skip_replay(capsys):
    argv = ["demo", "--rollouts", "2", "--max-len", "512", "--producers", "sglang", "skyrl"]
    assert main([*argv, "--no-replay"]) == 0
    out = capsys.readouterr().out
    assert "all equal" in out
    assert out.strip().endswith("replay not verified: not asked for")


@pytest.mark.parametrize("shape_name", ["glm-4.5-air", "kimi-k2"])
def test_a_step_checks_every_row_and_retention_deletes_every_file(shape_name, tmp_path):
    """(SGLang's int32 routes would widen the whole batch: its decoding is covered by the
    inspect tests.)"""
    shape = MODEL_SHAPES[shape_name]
    root = tmp_path / "payloads"
    report = play_step(
        shape,
        root,
        rollouts=6,
        micro_batches=3,
        max_len=4096,
        producers=("vllm", "prime-rl", "skyrl"),
        engine_bugs=1,
        workers=2,
    )
    assert report.ok
    assert report.mismatches == ()
    assert report.layout_errors == ()
    served = report.served
    assert (served.inline_rollouts, served.handle_rollouts) == (3, 3)
    assert len(served.zero_route_rollouts) == 1  # at most 1 asked for; 4096 tokens allow 2 turns
    assert report.stats.gaps == 1
    assert report.stats.samples == 6
    assert report.rows_checked == report.tokens
    assert report.packed_bytes == report.tokens * shape.route_bytes_per_token
    assert report.padded_bytes >= report.packed_bytes
    assert served.handle_route_bytes + served.inline_route_bytes == report.packed_bytes - sum(
        shape.route_bytes_per_token for _ in range(6)
    )  # every row but each rollout's never-forwarded last token
    assert report.files_deleted == len(served.files) > 0
    assert report.files_left == 0
    assert not any(files for _, _, files in os.walk(root))
    assert [(r.tp_rank, r.cp_rank) for r in report.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r.local_tokens for r in report.ranks}) == 1  # THD splits every sample evenly
    assert (
        report.ranks[0].route_bytes
        == report.ranks[0].local_tokens * len(shape.moe_layer_ids) * shape.topk * 4
    )
    assert report.replay.status == ("verified" if MEGATRON else "skipped")


def test_the_gap_line_counts_the_all_zero_rows_and_apart_the_good_rows_dropped(tmp_path):
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    report = play_step(shape, tmp_path / "p", rollouts=4, max_len=2048, replay=False)
    stats = report.stats
    assert stats.rows_missing > 0  # the engine bug's rows
    assert stats.rows_dropped > 0  # the sample's good rows, dropped with them
    line = next(row for row in summary(report).splitlines() if row.startswith("placeholders"))
    assert f"{stats.rows_missing:,} all-zero engine rows in 1 rollout" in line
    assert f"{stats.rows_dropped:,} good rows dropped with them" in line


@pytest.mark.slow
def test_the_demo_prints_no_third_party_warnings():
    argv = ["demo", "--rollouts", "2", "--max-len", "512", "--micro-batches", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "r3data.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "Warning" not in done.stdout


def test_the_summary_counts_one_of_a_thing_in_the_singular(tmp_path):
    """'1 micro-batches', '1 files written'."""
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    report = play_step(shape, tmp_path / "p", rollouts=2, micro_batches=1, max_len=64, replay=False)
    assert (report.micro_batches, len(report.served.files)) == (1, 1)
    text = summary(report)
    assert "  1 micro-batch, " in text
    assert "  1 file written, 1 deleted " in text


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("micro_batches", 0, r"micro_batches: expected an int >= 1, found 0"),  # ZeroDivisionError
        ("engine_bugs", -1, r"engine_bugs: expected an int >= 0, found -1"),  # all but one zeroed
    ],
)
def test_play_step_checks_its_counts_before_serving(tmp_path, option, value, message):
    with pytest.raises(ConfigError, match=message):
        play_step(MODEL_SHAPES["qwen3-30b-a3b"], tmp_path / "p", rollouts=2, **{option: value})
    assert not (tmp_path / "p").exists()
