"""``r3data inspect --timeout``: each call to a store that is not local-backed is bounded."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # stalling
from stalling import SlowMemory

from r3data.cli import main
from r3data.cli.inspect import SNIFF_BYTES
from r3data.payload import PayloadWriter
from r3data.synth import MODEL_SHAPES, SyntheticRouter, synth_rollouts, vllm_response

BOUND_S = 15.0
"""How long a command given ``--timeout 1`` may take against a stalled store (client setup
included); without the timeout it waits for as long as botocore's and s3fs's retries add up to
(minutes)."""


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of stderr, nothing on stdout."""
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    return line


@pytest.fixture(name="silent_s3")
def silent_s3_fixture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """An S3 endpoint (``AWS_ENDPOINT_URL``) that accepts connections and never answers."""
    s3fs = pytest.importorskip("s3fs")
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with server:
            while True:
                try:
                    held.append(server.accept()[0])  # held open, never read or answered
                except OSError:  # closed at teardown
                    return

    threading.Thread(target=accept, daemon=True).start()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
    }.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a plain s3:// URL builds its own, from the env
    yield
    s3fs.S3FileSystem.clear_instance_cache()
    server.close()
    for connection in held:
        connection.close()


@pytest.mark.parametrize(
    "path", ["s3://bucket/run/v0/x.bin", "s3://bucket/run/response.json", "s3://bucket/run"]
)
def test_inspect_of_a_silent_store_exits_2_within_its_timeout(silent_s3, path, capsys):
    """A payload file, a response and a directory: it waited on the store indefinitely."""
    started = time.monotonic()
    assert main(["inspect", path, "--timeout", "1"]) == 2
    assert time.monotonic() - started < BOUND_S
    assert _error(capsys) == (
        f"r3data: error: exists of {path}: no answer within the timeout of 1 s"
    )


class HeldStore(SlowMemory):
    """``r3heldinspect://``: one memory store every URL of it names, whose listings
    (``hold="find"``), kind look-ups (``"isdir"``) or reads after the first ``answered``
    (``"read"``) wait for ``release``."""

    protocol = "r3heldinspect"
    cachable = True
    answered = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.removeprefix("r3heldinspect://"))

    def before_read(self, path: str, offset: int) -> None:
        if self.hold == "read" and self.calls.count("read") > self.answered:
            self.release.wait()

    def isdir(self, path: str) -> bool:
        if self.hold == "isdir":
            self.release.wait()
        return super().isdir(path)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.hold == "find":
            self.release.wait()
        return super().find(path, *args, **kwargs)


@pytest.fixture(name="held")
def held_fixture() -> Iterator[tuple[str, HeldStore]]:
    """A root of one payload file and a vLLM response on ``r3heldinspect://``, and the store,
    answering until told not to."""
    fsspec.register_implementation("r3heldinspect", HeldStore, clobber=True)
    fs = fsspec.filesystem("r3heldinspect")
    fs.hold, fs.answered, fs.release = "", 0, threading.Event()
    root = f"r3heldinspect://run-{uuid.uuid4().hex}"
    PayloadWriter(root).write(0, {"routed_experts": np.zeros((4, 3, 2), np.uint8)})
    fs.pipe_file(f"{root}/response.json", _response())
    yield root, fs
    fs.release.set()


def _response() -> bytes:
    """A vLLM response longer than the head ``inspect`` reads first."""
    shape = MODEL_SHAPES["glm-4.5-air"]
    rollout = synth_rollouts(SyntheticRouter(shape, seed=3), 1, seed=3)[0]
    prompt_len, completion_len = rollout.requests[-1]
    body = vllm_response(
        rollout.routes[: rollout.tokens - 1],
        prompt_ids=rollout.token_ids[:prompt_len],
        completion_ids=rollout.token_ids[prompt_len : prompt_len + completion_len],
    )
    assert len(body) > SNIFF_BYTES
    return body


def test_inspect_of_a_store_that_answers_reads_through_the_bounded_calls(held, capsys):
    root, _ = held
    assert main(["inspect", root, "--timeout", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kind"], len(report["files"]), report["versions"]) == (
        "payload directory",
        1,
        [0],
    )
    assert main(["inspect", f"{root}/response.json", "--timeout", "1", "--json"]) == 0
    assert '"producer": "vllm' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("hold", "answered", "name"),
    [
        ("isdir", 0, "response.json"),  # what kind of path it is
        ("find", 0, ""),  # a directory's listing
        ("read", 0, "payload"),  # a payload file's head
        ("read", 0, "response.json"),  # a response's head
        ("read", 1, "response.json"),  # a response's body
    ],
)
def test_each_later_call_of_inspect_is_bounded_too(held, hold, answered, name, capsys):
    """Past the look-up: the kind, the listing, a file's head and a response's body."""
    root, fs = held
    path = fs._strip_protocol(root)
    if name == "payload":
        (path,) = (f for f in fs.find(path) if f.endswith(".bin"))
    elif name:
        path = f"{path}/{name}"
    url = fs.unstrip_protocol(path)
    fs.hold, fs.answered, fs.calls = hold, answered, []
    started = time.monotonic()
    assert main(["inspect", url, "--timeout", "1"]) == 2
    assert time.monotonic() - started < BOUND_S
    doing = f"reading {url} at offset 0" if hold == "read" else f"{hold} of {url}"
    assert _error(capsys) == f"r3data: error: {doing}: no answer within the timeout of 1 s"
    assert fs.calls.count("read") == answered + (hold == "read")


@pytest.mark.parametrize("timeout", ["0", "inf", "soon"])
def test_inspect_refuses_a_timeout_as_verify_does(written_root, timeout, capsys):
    assert main(["inspect", str(written_root.root), "--timeout", timeout]) == 2
    assert "--timeout" in _error(capsys)


def test_a_local_path_reads_as_without_the_timeout(written_root, capsys):
    name = written_root.segments[0].file
    for path in (written_root.root, written_root.root / name):
        assert main(["inspect", str(path), "--json"]) == 0
        plain = capsys.readouterr().out
        assert main(["inspect", str(path), "--json", "--timeout", "0.001"]) == 0
        assert capsys.readouterr().out == plain
