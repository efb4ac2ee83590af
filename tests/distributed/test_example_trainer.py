"""``examples/trainer_loop.py`` runs as documented: torchrun, two ranks (CP 2), one shared root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from realparts import free_port

EXAMPLE = Path(__file__).parents[2] / "examples" / "trainer_loop.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_example_trainer_loop_trains_every_step_and_frees_every_file(tmp_path):
    assert len(EXAMPLE.read_text().splitlines()) <= 40
    root = tmp_path / "payloads"
    env = {**os.environ, "PAYLOAD_ROOT": str(root), "PYTHONPATH": str(EXAMPLE.parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(EXAMPLE)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        for step in range(2):
            assert f"rank {rank}: step {step} trained" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert not [p for p in root.rglob("*") if p.is_file()]  # every payload file freed
