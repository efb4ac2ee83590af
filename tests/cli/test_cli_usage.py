"""``r3data`` help and usage errors: complete help, one-line errors, exit code 2."""

from __future__ import annotations

import argparse
import subprocess
import sys
import traceback

import numpy as np
import pytest

from r3data import loader
from r3data.cli import COMMANDS as CLI_COMMANDS
from r3data.cli import build_parser, main
from r3data.cli.common import error_line
from r3data.errors import R3DataError
from r3data.payload import PayloadWriter
from r3data.synth import MODEL_SHAPES, SyntheticRouter, sglang_response, synth_rollouts

COMMANDS = ("demo", "inspect", "verify", "gc", "bench")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def test_top_level_help_names_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out
    assert set(_subparsers()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_command_is_documented(command, capsys):
    assert main([command, "--help"]) == 0
    out = _squeezed(capsys.readouterr().out)  # help wraps lines, even inside option names
    parser = _subparsers()[command]
    assert _squeezed(parser.description) in out
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command}: {action.dest} has no help"
        assert _squeezed(action.help) in out
        for option in action.option_strings:
            assert option in out


@pytest.fixture
def paths(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a payload\n")
    root = tmp_path / "root"
    root.mkdir()
    rollout = synth_rollouts(SyntheticRouter(MODEL_SHAPES["qwen3-30b-a3b"]), 1, max_len=64)[0]
    p, c = rollout.requests[0]
    sglang = tmp_path / "sglang.json"
    sglang.write_bytes(
        sglang_response(rollout.routes[: p + c - 1], start=0, prompt_len=p, completion_len=c)
    )
    return {
        "text": str(text),
        "root": str(root),
        "missing": str(tmp_path / "missing"),
        "sglang": str(sglang),
    }


BAD = {
    "no command": [],
    "unknown command": ["frobnicate"],
    "zero rollouts": ["demo", "--rollouts", "0"],
    "unknown model shape": ["demo", "--model-shape", "gpt-2"],
    "max-len below 2": ["demo", "--max-len", "1"],
    "negative seed": ["demo", "--seed", "-1"],
    "missing path": ["inspect", "{missing}"],
    "unknown protocol": ["inspect", "nope://somewhere/file.bin"],
    "neither payload nor JSON": ["inspect", "{text}"],
    "SGLang without its shape": ["inspect", "{sglang}"],
    "verify a file": ["verify", "{text}"],
    "verify a missing root": ["verify", "{missing}"],
    "step without its bound": ["verify", "{root}", "--step", "3"],
    "gc without step": ["gc", "{root}"],
    "gc with a negative step": ["gc", "{root}", "--step", "-1", "--max-off-policy-steps", "1"],
    "gc with a word for a step": ["gc", "{root}", "--step", "x", "--max-off-policy-steps", "1"],
    "verify with a zero timeout": ["verify", "{root}", "--timeout", "0"],
    "verify with an endless timeout": ["verify", "{root}", "--timeout", "inf"],
    "gc with a word for a timeout": [
        "gc",
        "{root}",
        "--step",
        "1",
        "--max-off-policy-steps",
        "1",
        "--timeout",
        "soon",
    ],
    "bench folder missing": ["bench", "--benchmarks", "{missing}"],
    "bench folder without scripts": ["bench", "--benchmarks", "{root}"],
    "unknown benchmark": ["bench", "--only", "no-such-benchmark"],
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_and_paths_give_one_line_and_exit_code_2(case, paths, capsys):
    argv = [arg.format(**paths) for arg in BAD[case]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "error" in lines[0]
    assert "Traceback" not in captured.err


def test_an_error_raised_in_a_loader_thread_is_reported_on_one_line():
    samples = [{"id": "bad", "requests": []}]
    with pytest.raises(R3DataError) as info:
        list(loader(samples, batch_size=1, collate={"workers": 2}))
    # the original exception, its own message; the worker's frames in its traceback
    assert "Traceback" not in str(info.value)
    error, frames = info.value, []
    while error is not None:  # the sample's context wraps the error raised where it happened
        frames += [f.name for f in traceback.extract_tb(error.__traceback__)]
        error = error.__cause__
    assert "_rollout" in frames
    line = error_line(info.value)
    assert "\n" not in line
    assert line.startswith("r3data: error: sample 'bad' (index 0): ")
    assert "token_ids" in line


def test_top_level_help_answers_without_importing_torch():
    code = "import sys; from r3data.cli import main; main(['--help']); print(sorted(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = done.stdout.strip().splitlines()[-1]
    assert "'torch'" not in modules
    assert "'numpy'" not in modules
    for command in COMMANDS:
        assert command in done.stdout


def test_each_commands_one_line_help_is_its_modules_own():
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    registered = {choice.dest: choice.help for choice in action._choices_actions}
    assert registered == {name: summary for name, (_, summary) in CLI_COMMANDS.items()}


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """``r3data inspect --json ROOT | head -c 10``: no error line, no traceback, exit code 0."""
    writer = PayloadWriter(tmp_path)
    for _ in range(300):  # more JSON than a pipe buffers
        writer.write(0, {"routed_experts": np.ones((2, 2, 2), np.uint8)})
    command = [sys.executable, "-m", "r3data.cli", "inspect", "--json", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(10)
    process.stdout.close()
    assert process.wait(timeout=60) == 0
    assert process.stderr.read() == b""
