"""``r3data inspect``, ``verify`` and ``gc`` on real payload roots and producer responses."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import orjson
import pytest
from written_roots import SHAPE, bincount

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # stalling
from stalling import SlowMemory

from r3data.cli import main
from r3data.payload import PayloadWriter
from r3data.synth import (
    SyntheticRouter,
    primerl_response,
    sglang_response,
    skyrl_response,
    synth_rollouts,
    vllm_response,
)


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_verify_passes_a_clean_root(written_root, capsys):
    code, report = run_json(capsys, "verify", str(written_root.root))
    assert code == 0
    assert report["ok"]
    assert report["files_checked"] == len(written_root.routes)
    assert report["versions"] == [0, 1, 2]
    assert report["bytes_checked"] == sum(
        os.path.getsize(written_root.root / name) for name in written_root.routes
    )


def test_verify_reports_a_corrupt_byte_an_orphan_and_stale_versions(written_root, capsys):
    victim = written_root.segments[2]  # routes of version 1
    path = written_root.root / victim.file
    data = bytearray(path.read_bytes())
    data[victim.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    (written_root.root / "stray.bin").write_bytes(b"left behind")
    code, report = run_json(
        capsys, "verify", str(written_root.root), "--step", "1", "--max-off-policy-steps", "0"
    )
    assert code == 1
    assert list(report["corrupt"]) == [victim.file]
    assert "crc32c" in report["corrupt"][victim.file]
    assert report["orphans"] == ["stray.bin"]
    assert report["stale_versions"] == [0, 1]
    assert main(["verify", str(written_root.root)]) == 1
    text = capsys.readouterr().out
    assert f"corrupt    {victim.file}" in text
    assert "orphan     stray.bin" in text


def test_gc_dry_run_deletes_nothing_then_gc_removes_only_stale_versions(written_root, capsys):
    stale = sorted(name for name in written_root.routes if not name.startswith("v2/"))
    argv = ["gc", str(written_root.root), "--step", "2", "--max-off-policy-steps", "1"]
    code, report = run_json(capsys, *argv, "--dry-run")
    assert code == 0
    assert report["dry_run"]
    assert report["bound"] == 2
    assert sorted(report["files"]) == stale
    assert all((written_root.root / name).exists() for name in written_root.routes)
    code, report = run_json(capsys, *argv)
    assert code == 0
    assert sorted(report["files"]) == stale
    assert report["bytes"] > 0
    left = {
        os.path.relpath(os.path.join(d, f), written_root.root)
        for d, _, names in os.walk(written_root.root)
        for f in names
    }
    assert left == set(written_root.routes) - set(stale)
    assert main(["verify", str(written_root.root)]) == 0


def test_inspect_a_payload_file_lists_fields_and_counts_expert_load(written_root, capsys):
    name, routes = next(iter(written_root.routes.items()))
    code, report = run_json(capsys, "inspect", str(written_root.root / name))
    assert code == 0
    assert report["kind"] == "payload file"
    assert report["version"] == 0
    fields = {f["field"]: f for f in report["fields"]}
    assert fields["routed_experts"]["rows"] == routes.shape[0]
    assert fields["routed_experts"]["shape"] == list(routes.shape[1:])
    assert fields["sampling_mask"]["index"] is not None
    load = report["expert_load"]
    assert load["moe_layers"] == list(SHAPE.moe_layer_ids)
    assert load["per_expert"] == bincount([routes], load["experts"]).tolist()


def test_inspect_a_directory_sums_every_file(written_root, capsys):
    code, report = run_json(capsys, "inspect", str(written_root.root))
    assert code == 0
    assert sorted(f["file"] for f in report["files"]) == sorted(written_root.routes)
    assert report["versions"] == [0, 1, 2]
    load = report["expert_load"]
    assert (
        load["per_expert"] == bincount(list(written_root.routes.values()), load["experts"]).tolist()
    )
    assert main(["inspect", str(written_root.root)]) == 0
    text = capsys.readouterr().out
    assert "expert load:" in text
    assert f"{len(written_root.routes)} payload files" in text


def test_inspect_a_directory_lists_every_file_and_marks_corrupt_ones(written_root, capsys):
    """A corrupt file stopped inspect at the first one (exit 2, nothing listed)."""
    data_victim = written_root.segments[2]  # routes of version 1: a flipped data byte
    path = written_root.root / data_victim.file
    data = bytearray(path.read_bytes())
    data[data_victim.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    header_victim = written_root.segments[0].file  # version 0: a flipped byte of its table
    path = written_root.root / header_victim
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01
    path.write_bytes(bytes(data))
    (written_root.root / "stray.bin").write_bytes(b"left behind")
    healthy = written_root.segments[4].file
    code, report = run_json(capsys, "inspect", str(written_root.root))
    assert code == 1
    assert sorted(report["corrupt"]) == sorted([data_victim.file, header_victim])
    assert "expected crc32c" in report["corrupt"][data_victim.file]
    assert "header table checksum mismatch" in report["corrupt"][header_victim]
    assert [f["file"] for f in report["files"]] == sorted([data_victim.file, healthy])
    assert [o["file"] for o in report["not_payload_files"]] == ["stray.bin"]
    load = report["expert_load"]  # the routes of the healthy file only
    want = bincount([written_root.routes[healthy]], load["experts"])
    assert load["per_expert"] == want.tolist()
    assert main(["inspect", str(written_root.root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"  corrupt    {data_victim.file}: ") for line in lines)
    assert any(line.startswith(f"  corrupt    {header_victim}: ") for line in lines)
    assert "  not a payload file: stray.bin" in lines
    assert lines[-1] == "problems: 2 corrupt files"


@pytest.fixture
def rollout():
    return synth_rollouts(SyntheticRouter(SHAPE, seed=9), 1, seed=9, max_turns=2)[0]


def _body(producer: str, rollout, start: int, stop: int) -> bytes:
    rows = rollout.routes[start:stop]
    prompt_len, completion_len = rollout.requests[-1]
    if producer == "vllm":
        return vllm_response(
            rows,
            prompt_ids=rollout.token_ids[:prompt_len],
            completion_ids=rollout.token_ids[prompt_len : prompt_len + completion_len],
        )
    if producer == "sglang":
        return sglang_response(
            rows, start=start, prompt_len=prompt_len, completion_len=completion_len
        )
    if producer == "prime-rl":
        return primerl_response(rows, start=start)
    return skyrl_response(rows, start=start)


@pytest.mark.parametrize("producer", ["vllm", "sglang", "prime-rl", "skyrl"])
def test_inspect_detects_each_producer_and_counts_its_routes(producer, rollout, tmp_path, capsys):
    start = 0 if producer == "vllm" else rollout.route_span(len(rollout.requests) - 1)[0]
    stop = rollout.tokens - 1
    path = tmp_path / "response.json"
    path.write_bytes(_body(producer, rollout, start, stop))
    extra = ["--model-shape", SHAPE.name] if producer == "sglang" else []
    if producer in ("sglang", "skyrl"):  # the request's prompt start: not in their bodies
        extra += ["--start", str(start)]
    code, report = run_json(capsys, "inspect", str(path), *extra)
    assert code == 0
    assert report["producer"] == producer
    (rows,) = report["routes"]
    assert (rows["pos"], rows["end"]) == (start, stop)
    assert rows["row_shape"] == list(SHAPE.row_shape)
    assert rows["dense_layers"] == list(range(SHAPE.dense_layers))
    load = report["expert_load"]
    assert load["per_expert"] == bincount([rollout.routes[start:stop]], load["experts"]).tolist()


def test_inspect_lists_by_handle_segments_and_flags_all_zero_routes(written_root, tmp_path, capsys):
    handles = tmp_path / "handles.json"
    segment = written_root.segments[0].to_dict()
    handles.write_bytes(orjson.dumps({"choices": [{"index": 0, "payload": [segment]}]}))
    code, report = run_json(capsys, "inspect", str(handles))
    assert code == 0
    assert report["producer"] == "prime-rl"
    assert report["handles"] == [segment]
    assert report["routes"] == []

    zeros = tmp_path / "zeros.json"
    zeros.write_bytes(primerl_response(np.zeros((6, *SHAPE.row_shape), np.uint8), start=0))
    code, report = run_json(capsys, "inspect", str(zeros))
    assert code == 0
    assert any("all 6 route rows are zero" in w for w in report["warnings"])
    assert report["expert_load"] is None
    assert main(["inspect", str(zeros)]) == 0
    assert "warning: prime-rl choices[0].routed_experts: all 6 route rows are zero" in (
        capsys.readouterr().out
    )


def test_fsspec_urls_work_like_local_paths(capsys):
    root = f"memory://r3data-cli-{uuid.uuid4().hex}/payloads"
    routes = np.random.default_rng(0).integers(0, 16, (12, 3, 2)).astype(np.uint8)
    (segment,) = PayloadWriter(root).write(4, {"routed_experts": routes})
    code, report = run_json(capsys, "inspect", f"{root}/{segment.file}")
    assert code == 0
    assert report["version"] == 4
    assert report["expert_load"]["per_expert"] == np.bincount(routes.reshape(-1)).tolist()
    code, report = run_json(capsys, "verify", root)
    assert (code, report["files_checked"]) == (0, 1)
    code, report = run_json(capsys, "gc", root, "--step", "9", "--max-off-policy-steps", "2")
    assert (code, report["files"]) == (0, [segment.file])
    code, report = run_json(capsys, "verify", root)
    assert (code, report["files_checked"]) == (0, 0)


class StalledStore(SlowMemory):
    """``r3stalled://``: a memory store of its own, the one instance every URL of it names
    (the CLI makes its filesystem from the URL)."""

    protocol = "r3stalled"
    cachable = True

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.removeprefix("r3stalled://"))


@pytest.fixture(name="stalled")
def stalled_fixture() -> Any:
    """A root of three files on ``r3stalled://`` and the store, answering until told not to."""
    fsspec.register_implementation("r3stalled", StalledStore, clobber=True)
    fs = fsspec.filesystem("r3stalled")
    fs.hold, fs.release = "", threading.Event()
    root = f"r3stalled://run-{uuid.uuid4().hex}"
    routes = np.zeros((4, 3, 2), np.uint8)
    for version in range(3):
        PayloadWriter(root).write(version, {"routed_experts": routes})
    yield root, fs
    fs.release.set()


def test_gc_timeout_stops_a_run_on_a_stalled_store_at_its_first_deletion(stalled, capsys):
    root, fs = stalled
    fs.hold = "rm"
    argv = ["gc", root, "--step", "9", "--max-off-policy-steps", "1", "--timeout", "0.2"]
    code, report = run_json(capsys, *argv)  # without the timeout it waits on the store forever
    assert code == 1
    assert report["files"] == []
    (error,) = report["errors"]
    assert "no answer within the timeout of 0.2 s" in error
    assert "1 of 3 files tried" in error


def test_verify_timeout_bounds_each_look_at_a_stalled_store(stalled, capsys):
    root, fs = stalled
    code, report = run_json(capsys, "verify", root, "--timeout", "0.2")
    assert (code, report["files_checked"]) == (0, 3)
    fs.hold = "info"  # without the timeout, verify waits on the store forever
    assert main(["verify", root, "--timeout", "0.2"]) == 2
    error = capsys.readouterr().err
    assert "no answer within the timeout of 0.2 s" in error
    assert root.removeprefix("r3stalled://") in error


def test_inspect_a_corrupt_payload_file_reports_it_with_exit_code_1(written_root, capsys):
    """A payload file whose routes fail their checksum, or whose header table does, is a
    problem found (exit 1, as for a directory holding it), not a bad argument: it ended
    with one error line and exit code 2, its header unshown."""
    data_victim, header_victim = written_root.segments[2], written_root.segments[0].file
    path = written_root.root / data_victim.file
    data = bytearray(path.read_bytes())
    data[data_victim.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    code, report = run_json(capsys, "inspect", str(path))
    assert code == 1
    assert [f["field"] for f in report["fields"]] == ["routed_experts", "sampling_mask"]
    assert "expected crc32c" in report["corrupt"][str(path)]
    assert report["expert_load"] is None
    assert main(["inspect", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: payload file (format 1), policy version 1")
    assert any(line.startswith(f"  corrupt    {path}: ") for line in lines)
    assert lines[-1] == "problems: 1 corrupt file"
    path = written_root.root / header_victim
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01
    path.write_bytes(bytes(data))
    code, report = run_json(capsys, "inspect", str(path))
    assert code == 1
    assert "header table checksum mismatch" in report["corrupt"][str(path)]
    assert main(["inspect", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: payload file, corrupt"
    assert lines[-1] == "problems: 1 corrupt file"
