"""``r3data inspect`` recognises every producer format, streams included, from bodies built as
each producer builds them, and reports their rows at the right positions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from producer_bodies import nemorl_bodies, primerl_bodies, sglang_bodies, skyrl_bodies, vllm_bodies

from r3data.cli import main

LAYERS, TOPK = 4, 2
ROWS = np.argsort(np.random.default_rng(3).random((7, LAYERS, 8)), axis=-1)[..., :TOPK] + 1
PROMPT, COMPLETION = [1, 2, 3, 4, 5], [6, 7, 8]  # 7 forwarded positions
SAMPLE = vllm_bodies.Prompt(PROMPT, [vllm_bodies.Sample(COMPLETION, ROWS)])
ITEM = sglang_bodies.Item(PROMPT, COMPLETION, ROWS)
KEPT = [np.array([3, 9], np.int32), np.empty(0, np.int32), np.array([4], np.int32)]
SHAPE = ["--num-layers", str(LAYERS), "--topk", str(TOPK)]

BODIES = {
    "vllm completions": ("vllm", vllm_bodies.completion_body([SAMPLE], num_experts=8), [], 0),
    "vllm chat": ("vllm", vllm_bodies.chat_body(SAMPLE, num_experts=8, prompt_start=2), ["--start", "2"], 2),
    "vllm tokens stream": ("vllm", vllm_bodies.tokens_stream(SAMPLE, num_experts=8), [], 0),
    "vllm 0.21": ("vllm-0.21", vllm_bodies.completion_body_v021([SAMPLE], moe_layers=(1, 2, 3)), [], 0),
    "sglang": ("sglang", sglang_bodies.generate_body([ITEM], start_len=3), [*SHAPE, "--start", "3"], 3),
    "sglang stream": ("sglang", sglang_bodies.generate_stream(ITEM), SHAPE, 0),
    "sglang openai": ("sglang-openai", sglang_bodies.openai_body([ITEM], chat=False), SHAPE, 0),
    "sglang openai stream": ("sglang-openai", sglang_bodies.openai_stream(ITEM), SHAPE, 0),
    "prime-rl": (
        "prime-rl",
        primerl_bodies.generate_body(
            [{
                "token_ids": COMPLETION,
                "routed_experts": primerl_bodies.routed_experts_envelope(ROWS[1:], start=1),
                "kept_tokens": primerl_bodies.kept_tokens_field(KEPT, num_tokens=3),
            }],
            prompt_len=5,
            with_kept_tokens=True,
        ),
        ["--prompt-len", "5"],
        1,
    ),
    "skyrl": ("skyrl", skyrl_bodies.generate_body(COMPLETION, ROWS[2:]), ["--start", "2"], 2),
    "skyrl v1": ("skyrl-v1", skyrl_bodies.generate_body(COMPLETION, ROWS, version=1), [], 0),
    "nemo-rl": (
        "nemo-rl",
        nemorl_bodies.chat_body(nemorl_bodies.aligned_rows(ROWS, 5, 3, num_experts=8), COMPLETION),
        [],
        0,
    ),
}  # fmt: skip


def inspect(capsys, tmp_path, raw: bytes, *argv: str) -> dict:
    path = tmp_path / "response.json"
    path.write_bytes(raw)
    assert main(["inspect", str(path), *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", sorted(BODIES))
def test_inspect_names_the_format_and_places_its_rows(case, capsys, tmp_path):
    name, raw, argv, start = BODIES[case]
    report = inspect(capsys, tmp_path, raw, *argv)
    assert report["producer"] == name
    (routes,) = report["routes"] if name != "vllm-0.21" else [report["routes"][1]]
    assert (routes["pos"], routes["end"]) == ((5, 7) if name == "vllm-0.21" else (start, 7))
    assert routes["producer"] == name
    assert report["missing"] == []
    assert report["expert_load"]["assignments"] > 0


def test_inspect_reports_the_moe_axis_masks_and_no_route_rows(capsys, tmp_path):
    _name, raw, *_ = BODIES["vllm 0.21"]
    prompt, _generated = inspect(capsys, tmp_path, raw)["routes"]
    assert (prompt["pos"], prompt["layer_axis"], prompt["row_shape"]) == (0, "moe", [3, TOPK])
    report = inspect(capsys, tmp_path, BODIES["prime-rl"][1], "--prompt-len", "5")
    (mask,) = report["side_fields"]
    assert (mask["field"], mask["pos"], mask["rows"], mask["rows_without_ids"]) == (
        "sampling_mask",
        5,
        3,
        1,
    )
    note = inspect(capsys, tmp_path, BODIES["prime-rl"][1])["notes"]  # no prompt length
    assert note
    assert "without the prompt length" in note[0]
    missing = nemorl_bodies.aligned_rows(ROWS[:5], 5, 3, num_experts=8)
    report = inspect(capsys, tmp_path, nemorl_bodies.chat_body(missing, COMPLETION))
    assert any("2 route rows hold negative ids" in w for w in report["warnings"])
    assert main(["inspect", str(tmp_path / "response.json")]) == 0
    assert "nemo-rl response" in capsys.readouterr().out


def test_inspect_lists_every_version_a_body_could_be(capsys, tmp_path):
    report = inspect(capsys, tmp_path, sglang_bodies.generate_body([ITEM]), *SHAPE)
    assert report["formats"] == ["sglang", "sglang-0.5.7"]
    forced = inspect(
        capsys, tmp_path, sglang_bodies.generate_body([ITEM]), *SHAPE, "--producer", "sglang-0.5.7"
    )
    assert forced["producer"] == "sglang-0.5.7"


def test_inspect_refuses_a_body_no_format_recognises(tmp_path, capsys):
    path = tmp_path / "stream.json"
    path.write_bytes(vllm_bodies.openai_stream_chunks(SAMPLE))  # vLLM's OpenAI streams: no routes
    assert main(["inspect", str(path)]) != 0
    assert "cannot tell which producer wrote this response" in capsys.readouterr().err
