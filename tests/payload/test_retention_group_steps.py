"""Retention with a gloo group whose ranks call ``on_policy_update`` with different or invalid
steps: every rank raises the same ConfigError, none is left waiting, and no claim is lost."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from r3data.errors import ConfigError
from r3data.payload import PayloadRetention, PayloadWriter

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from rank_helpers import spawn_ranks

ROW = np.zeros((3, 4), np.uint8)


def _update(retention: PayloadRetention, step: Any) -> str | None:
    """``on_policy_update(step)``: None, or the ConfigError's message."""
    try:
        retention.on_policy_update(step)
    except ConfigError as exc:
        return str(exc)
    return None


def _left(root: str, files: list[str], retention: PayloadRetention) -> list[str]:
    """The files still there once rank 0's deletions are done."""
    retention.wait()
    dist.barrier()
    return sorted(f for f in files if os.path.exists(os.path.join(root, f)))


def mismatched_steps(rank: int, store: str, root: str, files: list[str]) -> dict:
    """Rank 1 claims ``later`` for step 3 and discards ``dropped``, rank 0 claims ``early`` for
    step 0; rank 1 then reports step 1 while rank 0 reports 0, and both go on correctly."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        later, early, dropped = files
        retention = PayloadRetention(root, 5, fresh=False, group=dist.group.WORLD)
        if rank == 1:
            retention.claim(3, [later])
            retention.discard([dropped])
        else:
            retention.claim(0, [early])
        errors = [_update(retention, rank)]
        left = [_left(root, files, retention)]
        for step in (1, 2, 3):
            errors.append(_update(retention, step))
            left.append(_left(root, files, retention))
        return {"errors": errors, "left": left}
    finally:
        dist.destroy_process_group()


def invalid_steps(rank: int, store: str, root: str, files: list[str]) -> dict:
    """Rank 1 claims ``kept`` for step 1, then passes 1.5 while rank 0 passes 0, then both pass
    -1, then both go on correctly."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        retention = PayloadRetention(root, 5, fresh=False, group=dist.group.WORLD)
        if rank == 1:
            retention.claim(1, files)
        errors = [_update(retention, 1.5 if rank == 1 else 0), _update(retention, -1)]
        left = []
        for step in (0, 1):
            errors.append(_update(retention, step))
            left.append(_left(root, files, retention))
        return {"errors": errors, "left": left}
    finally:
        dist.destroy_process_group()


def test_mismatched_steps_raise_on_every_rank_and_keep_every_claim(tmp_path):
    """Both ranks raise naming the steps found; the file rank 1 claimed for step 3 stays until
    step 3 is released, and its discard, sent with the failed update, goes at the next one."""
    root = tmp_path / "payloads"
    writer = PayloadWriter(str(root))
    files = [writer.write(3, {"routes": ROW})[0].file for _ in range(3)]
    later = files[0]
    reports = spawn_ranks(
        mismatched_steps, 2, (str(tmp_path / "store"), str(root), files), deadline_s=90
    )
    for report in reports.values():
        first, *rest = report["errors"]
        assert first is not None
        assert "rank 1 finished step 1 while rank 0 finished 0" in first
        assert rest == [None, None, None]
        assert report["left"] == [
            sorted(files),  # nothing released by the failed update
            [later],  # step 1: rank 0's claim released, rank 1's discard due
            [later],
            [],  # step 3: rank 1's claim released
        ]
    assert reports[0]["errors"] == reports[1]["errors"]


def test_an_invalid_step_raises_on_every_rank_and_none_waits(tmp_path):
    """An invalid step on one rank is a mismatch on every rank; the same invalid step on every
    rank is each rank's own ConfigError; the group stays in step and the claim stays."""
    root = tmp_path / "payloads"
    files = [PayloadWriter(str(root)).write(3, {"routes": ROW})[0].file]
    reports = spawn_ranks(
        invalid_steps, 2, (str(tmp_path / "store"), str(root), files), deadline_s=90
    )
    for report in reports.values():
        mismatch, invalid, *rest = report["errors"]
        assert mismatch is not None
        assert "rank 1 finished step 1.5 while rank 0 finished 0" in mismatch
        assert invalid is not None
        assert "step: expected an int >= 0, found -1" in invalid
        assert rest == [None, None]
        assert report["left"] == [files, []]
    assert reports[0]["errors"] == reports[1]["errors"]
