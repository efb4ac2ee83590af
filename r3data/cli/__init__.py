"""``r3data`` command line: a thin shell over the library.

``r3data demo`` plays one RL step on synthetic rollouts; ``inspect``, ``verify`` and ``gc``
look after payload files and responses; ``bench`` runs the benchmarks. Bad arguments and bad
paths end with a one-line error on stderr and exit code 2.
"""

from __future__ import annotations

import sys

from r3data.cli import bench, demo, inspect, payload
from r3data.cli.common import CommandParser, error_line
from r3data.errors import R3DataError

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="r3data",
        description="MoE router-replay data: play a demo step, inspect and look after payload "
        "files, run the benchmarks.",
        epilog="Run 'r3data COMMAND --help' for a command's options. Exit codes: 0 ok, 1 the "
        "command found problems, 2 bad arguments or paths.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (demo, inspect, payload, bench):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``r3data`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except (R3DataError, OSError) as exc:
        print(error_line(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("r3data: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
