"""``r3data`` command line: a thin shell over the library.

``r3data demo`` plays one RL step on synthetic rollouts; ``inspect``, ``verify`` and ``gc``
look after payload files and responses; ``bench`` runs the benchmarks. Bad arguments and bad
paths end with a one-line error on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from importlib import import_module

from r3data.cli.common import CommandParser, error_line
from r3data.errors import R3DataError

__all__ = ["COMMANDS", "build_parser", "main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

COMMANDS = {
    "demo": ("demo", "play one RL step on synthetic rollouts (no network, under a minute)"),
    "inspect": ("inspect", "show what a payload file, payload directory or JSON response holds"),
    "verify": ("payload", "check every payload file and checksum under a root"),
    "gc": ("payload", "delete payload versions no future batch may use (retention backstop)"),
    "bench": ("bench", "run every benchmark; write JSON and plots; print ratios against targets"),
}
"""Each command: the module under ``r3data.cli`` that registers it, and its one-line help.
Only the module of the command being run is imported (``r3data --help`` imports no torch)."""


def build_parser(load: Collection[str] | None = None) -> CommandParser:
    """The parser; ``load`` names the commands whose modules register their full options
    (default: every command); the others appear with their one-line help only."""
    parser = CommandParser(
        prog="r3data",
        description="MoE router-replay data: play a demo step, inspect and look after payload "
        "files, run the benchmarks.",
        epilog="Run 'r3data COMMAND --help' for a command's options. Exit codes: 0 ok, 1 the "
        "command found problems, 2 bad arguments or paths.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = {COMMANDS[name][0] for name in (COMMANDS if load is None else load)}
    registered: set[str] = set()
    for name, (module, summary) in COMMANDS.items():
        if module not in wanted:
            commands.add_parser(name, help=summary)
        elif module not in registered:
            import_module(f"r3data.cli.{module}").register(commands)
            registered.add(module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``r3data`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([command] if command in COMMANDS else [])
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except BrokenPipeError:  # `r3data inspect --json ... | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except (R3DataError, OSError) as exc:
        print(error_line(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("r3data: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
