"""Review of the CLI against hostile names and contents: no traceback, no faked line, nothing
allocated for a corrupt id, JSON that parses, and nothing written anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from r3data.cli import main
from r3data.payload import PayloadWriter
from r3data.synth import vllm_response

ROUTES = np.array([[[1, 2], [3, 0]], [[2, 3], [1, 0]], [[0, 1], [2, 0]]], np.uint8)
"""Three rows of two MoE layers, top-2, experts 0..3."""

HOSTILE_NAMES = {
    "not UTF-8": b"\xff\xfe.bin",
    "a newline faking a line": b"evil\nok.bin",
    "a terminal escape": b"\x1b[2Jclear.bin",
}


def hostile_root(root: Path) -> dict[str, str]:
    """A root whose v1 holds a corrupt payload file under each hostile name; the names as
    Python lists them."""
    writer = PayloadWriter(root)
    listed = {}
    for case, name in HOSTILE_NAMES.items():
        (segment,) = writer.write(1, {"routed_experts": ROUTES})
        path = root / segment.file
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        os.rename(path, os.fsencode(root / "v1") + b"/" + name)
        listed[case] = "v1/" + os.fsdecode(name)
    return listed


def one_line_per_problem(out: str) -> list[str]:
    lines = out.splitlines()
    assert all(line.isprintable() for line in lines), lines
    return lines


def test_verify_shows_hostile_file_names_escaped_one_line_each(tmp_path, capsys):
    """A name that is not UTF-8 ended verify with a UnicodeEncodeError traceback on a UTF-8
    terminal; a newline in a name printed a line of its own (here: a fake "ok")."""
    listed = hostile_root(tmp_path)
    assert main(["verify", str(tmp_path)]) == 1
    lines = one_line_per_problem(capsys.readouterr().out)
    corrupt = [line for line in lines if line.startswith("  corrupt ")]
    assert len(corrupt) == len(HOSTILE_NAMES)
    assert "ok" not in lines
    assert any("v1/\\udcff\\udcfe.bin: field 'routed_experts'" in line for line in corrupt)
    assert any("v1/evil\\nok.bin: field" in line for line in corrupt)
    assert any("v1/\\x1b[2Jclear.bin: field" in line for line in corrupt)
    assert main(["verify", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["corrupt"]) == sorted(listed.values())  # JSON keeps the real names


def test_inspect_shows_hostile_file_and_field_names_escaped(tmp_path, capsys):
    (tmp_path / "v1").mkdir()
    writer = PayloadWriter(tmp_path)
    (segment,) = writer.write(1, {"routes\nfaked 0 0 uint8": ROUTES})
    named = os.fsencode(tmp_path / "v1") + b"/\xff.bin"
    os.rename(tmp_path / segment.file, named)
    assert main(["inspect", os.fsdecode(named)]) == 0
    lines = one_line_per_problem(capsys.readouterr().out)
    assert lines[0].startswith(f"{tmp_path}/v1/\\udcff.bin: payload file (format 1)")
    assert any(line.startswith("routes\\nfaked 0 0 uint8  0 ") for line in lines)
    assert main(["inspect", str(tmp_path)]) == 0
    lines = one_line_per_problem(capsys.readouterr().out)
    assert any(line.startswith("v1/\\udcff.bin  v1 ") for line in lines)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in report["files"]] == ["v1/\udcff.bin"]
    assert report["files"][0]["fields"][0]["field"] == "routes\nfaked 0 0 uint8"


def test_inspect_of_a_payload_file_leaves_out_rows_without_a_route(tmp_path, capsys):
    """-1 is "no route" (NeMo-RL): such rows are left out of the expert load, as they are for a
    response; a payload file holding them ended inspect with an expert_load error."""
    routes = ROUTES.astype(np.int16)
    routes[1, 0, 0] = -1
    (segment,) = PayloadWriter(tmp_path).write(1, {"routed_experts": routes})
    assert main(["inspect", str(tmp_path / segment.file), "--json"]) == 0
    load = json.loads(capsys.readouterr().out)["expert_load"]
    kept = routes[[0, 2]]
    assert load["assignments"] == kept.size
    assert load["per_expert"] == np.bincount(kept.reshape(-1), minlength=4).tolist()


def test_inspect_refuses_an_expert_id_too_large_to_count_before_allocating(tmp_path, capsys):
    """An id of 2**40 in an int64 route field made inspect size its histogram by it (16 TiB):
    a typed error on one line instead."""
    routes = ROUTES.astype(np.int64)
    routes[2, 1, 1] = 2**40
    (segment,) = PayloadWriter(tmp_path).write(1, {"routed_experts": routes})
    assert main(["inspect", str(tmp_path / segment.file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "r3data: error: expert load: expected expert ids below 65536, found 1099511627776"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "{root}"],
        ["verify", "{root}", "--json", "--step", "1", "--max-off-policy-steps", "1"],
        ["inspect", "{root}"],
        ["inspect", "{root}/{file}", "--json"],
        ["gc", "{root}", "--step", "0", "--max-off-policy-steps", "5", "--dry-run"],
    ],
)
def test_read_only_commands_write_nothing_anywhere(tmp_path, monkeypatch, capsys, argv):
    root = tmp_path / "root"
    (segment,) = PayloadWriter(root).write(1, {"routed_experts": ROUTES})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    code = main([a.format(root=root, file=segment.file) for a in argv])
    out = capsys.readouterr().out
    assert code == 0, out
    if "--json" in argv:
        json.loads(out)
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def test_an_error_naming_a_hostile_path_stays_one_printable_line(tmp_path, capsys):
    missing = os.fsdecode(os.fsencode(tmp_path) + b"/\x1b[31mred\xff")
    assert main(["inspect", missing]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.isprintable()
    assert line == f"r3data: error: {tmp_path}/\\x1b[31mred\\udcff: no such file or directory"


def test_inspect_reads_a_json_response_after_leading_whitespace(tmp_path, capsys):
    """JSON may open with whitespace; a body with more than eight bytes of it (a saved file
    that starts with blank lines) was refused as neither a payload file nor JSON, because
    only the magic's eight bytes were looked at."""
    body = vllm_response(ROUTES, prompt_ids=[1, 2], completion_ids=[3, 4])
    path = tmp_path / "response.json"
    path.write_bytes(b"\n" * 12 + b"  \t" + body)
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["producer"] == "vllm"
    assert [r["rows"] for r in report["routes"]] == [3]


def test_inspect_leaves_all_zero_engine_rows_out_of_the_expert_load(tmp_path, capsys):
    """A row zero in every layer is a known engine bug the loader treats as missing; counted,
    it made expert 0 look hot in every MoE layer (the rows the loader keeps were meant)."""
    routes = np.concatenate([ROUTES, np.zeros((5, 2, 2), np.uint8)])
    body = vllm_response(routes, prompt_ids=[1, 2], completion_ids=list(range(7)))
    path = tmp_path / "response.json"
    path.write_bytes(body)
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("5 of 8 route rows are zero" in w for w in report["warnings"])
    load = report["expert_load"]
    assert load["assignments"] == ROUTES.size
    assert load["per_expert"] == np.bincount(ROUTES.reshape(-1), minlength=4).tolist()


def test_inspect_counts_every_expert_of_the_model_shape_in_payload_files(tmp_path, capsys):
    """--model-shape gives the expert count; payload files and directories ignored it, so
    experts above the largest id seen (never picked: the coolest) were left out."""
    (segment,) = PayloadWriter(tmp_path).write(1, {"routed_experts": ROUTES})
    for path in (tmp_path / segment.file, tmp_path):
        assert main(["inspect", str(path), "--json", "--model-shape", "qwen3-30b-a3b"]) == 0
        load = json.loads(capsys.readouterr().out)["expert_load"]
        assert load["experts"] == 128
        assert len(load["per_expert"]) == 128
        assert load["per_expert"][4:] == [0] * 124
