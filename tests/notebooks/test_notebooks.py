"""The notebooks run top to bottom on the CPU, and what they print holds up."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MEGATRON = importlib.util.find_spec("megatron") is not None

pytestmark = pytest.mark.slow


def execute(name: str, tmp_path: Path) -> tuple[dict, int]:
    """Run a notebook in ``tmp_path``; return the JSON its last cell prints and its plots."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(
        notebook,
        timeout=120,
        # a loaded machine can deliver a cell's output after its reply: wait for it, never drop it
        iopub_timeout=60,
        raise_on_iopub_timeout=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    warned = [out.text for out in outputs if out.output_type == "stream" and out.name == "stderr"]
    assert not warned, warned  # no third-party warnings (megatron's, say) either
    plots = sum("image/png" in out.get("data", {}) for out in outputs)
    last = notebook.cells[-1].outputs[-1]["text"].strip().splitlines()[-1]
    return json.loads(last), plots


def test_routes_on_the_wire(tmp_path):
    summary, plots = execute("01_routes_on_the_wire.ipynb", tmp_path)
    assert summary["decoded_equal"] == dict.fromkeys(("vllm", "sglang", "prime-rl", "skyrl"), True)
    assert summary["rows"] > 0
    per_token = summary["bytes_per_token"]
    assert set(per_token) == {"qwen3-30b-a3b", "glm-4.5-air", "deepseek-v3", "kimi-k2"}
    for sizes in per_token.values():
        assert sizes["engine"] < sizes["base64 on the wire"] < sizes["int64 in a trainer"]
    assert per_token["kimi-k2"]["engine"] == 2 * per_token["deepseek-v3"]["engine"]  # uint16 ids
    assert plots == 2


def test_by_handle(tmp_path):
    summary, plots = execute("02_by_handle.ipynb", tmp_path)
    for check in ("clipped_equal", "stitched_equal", "masks_equal", "loader_equal"):
        assert summary[check] is True, check
    final, peak = summary["final_bytes"], summary["max_bytes"]
    assert final["no deletion"] == peak["no deletion"]  # it only grows
    assert peak["delete on consume"] < peak["backstop only"] < final["no deletion"]
    assert plots == 1


def test_layout_and_replay(tmp_path):
    summary, plots = execute("03_layout_and_replay.ipynb", tmp_path)
    assert summary["every_token_once"] is True
    assert len(set(summary["bshd_tokens_per_rank"].values())) == 1
    for sizes in summary["bytes"].values():
        assert sizes["packed"] <= sizes["padded"]
    assert summary["bytes"]["heavy_tail"]["packed"] < summary["bytes"]["uniform"]["packed"]
    assert summary["replay"] == ("verified" if MEGATRON else "skipped")
    assert summary["loop_steps"] == 2
    assert summary["loop_files_left"] == 0
    assert summary["loop_root_left"] is False  # was a mkdtemp folder left behind every run
    assert plots == 2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs r3data[hf]")
def test_huggingface_replay(tmp_path):
    summary, plots = execute("04_huggingface_replay.ipynb", tmp_path)
    assert summary["routes_equal"] is True
    assert 0.0 <= summary["max_logit_diff"] < 1e-5  # only the last tokens' placeholders differ
    exact = summary["drifted_exact"]
    assert exact[0] == exact[1] == 1.0  # layers before the drifted one agree fully
    assert summary["drifted_worst_layer"] == 2
    assert exact[2] < 1.0
    assert summary["replayed_equal"] is True
    assert summary["unreplayed_exact"] < 1.0
    rates = summary["replace_rates"]
    assert rates == sorted(rates)  # a stricter ratio replaces more
    assert rates[-1] > 0.0
    assert plots == 1
