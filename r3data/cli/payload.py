"""``r3data verify`` and ``r3data gc``: check a payload root, and the retention backstop."""

from __future__ import annotations

import argparse
import json

from r3data.cli.common import EXIT_PROBLEMS, count, format_bytes, int_at_least, printable
from r3data.errors import ConfigError
from r3data.payload import PayloadRoot, gc, verify
from r3data.payload.fs import DEFAULT_TIMEOUT_S, checked_timeout


def register(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "verify",
        help="check every payload file and checksum under a root",
        description="Walk a payload root (a path or fsspec URL): check every payload file's "
        "header and CRC-32C checksums, and report files that cannot be read safely (a symlink "
        "out of the root, a FIFO or device, no permission: never followed or opened), files "
        "outside any v<k> directory (orphans), files left half-written by a writer that died "
        "(temporary), headerless files (not checkable without their segments) and, with --step "
        "and --max-off-policy-steps, versions past the retention bound. Exit code 1 when a file "
        "is corrupt or unreadable, an orphan exists or a version is stale.",
    )
    check.add_argument("root", metavar="ROOT", help="payload root: a directory or fsspec URL")
    _retention_arguments(check, required=False)
    check.add_argument(
        "--workers", type=int_at_least(1), help="files checked at once (default: I/O workers)"
    )
    timeout_argument(check, "a look-up, a listing or a ranged read")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(run=run_verify)

    sweep = commands.add_parser(
        "gc",
        help="delete payload versions no future batch may use (retention backstop)",
        description="Remove every v<k> directory with k < max(0, STEP + 1 - M): files of "
        "policy versions that no batch after training step STEP may use when batches are at "
        "most M steps off-policy. The same rule PayloadRetention applies online; use it after "
        "a crash or on a root no trainer is attached to. Exit code 1 when a file could not be "
        "deleted.",
    )
    sweep.add_argument("root", metavar="ROOT", help="payload root: a directory or fsspec URL")
    _retention_arguments(sweep, required=True)
    sweep.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted, delete nothing"
    )
    timeout_argument(sweep, "a look-up, a listing or a deletion; the first past it stops the run")
    sweep.add_argument("--json", action="store_true", help="print the report as JSON")
    sweep.set_defaults(run=run_gc)


def _retention_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--step",
        type=int_at_least(0),
        required=required,
        help="the last training step the trainer finished",
    )
    parser.add_argument(
        "--max-off-policy-steps",
        type=int_at_least(0),
        required=required,
        metavar="M",
        help="how many steps older than the current one a batch's rollouts may be",
    )


def timeout_argument(parser: argparse.ArgumentParser, calls: str) -> None:
    """Add ``--timeout`` (seconds per call to a root that is not local-backed) to ``parser``;
    ``calls`` names the calls it bounds in the help."""
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds one call to a root that is not local-backed may take ({calls}; "
        f"default {DEFAULT_TIMEOUT_S:g})",
    )


def _seconds(text: str) -> float:
    """An argparse type: a timeout in seconds (:func:`checked_timeout`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, found {text!r}") from None
    try:
        return checked_timeout(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _root(text: str, timeout: float) -> PayloadRoot:
    """The payload root ``text`` names, a directory (on an object store an empty prefix is an
    empty root), looked at with each call bounded by ``timeout``."""
    try:
        root = PayloadRoot(text, timeout=timeout)
    except (ValueError, ImportError) as exc:  # an unknown protocol, its client not installed
        raise ConfigError(f"cannot open {text!r}: {exc}") from None
    root.require()
    if root.call("isfile", root.path):
        raise ConfigError(f"{text}: expected a directory (a payload root), found a file")
    return root


def run_verify(args: argparse.Namespace) -> int:
    if (args.step is None) != (args.max_off_policy_steps is None):
        raise ConfigError("verify: give both --step and --max-off-policy-steps, or neither")
    root = _root(args.root, args.timeout)
    report = verify(
        root.path,
        fs=root.fs,
        step=args.step,
        max_off_policy_steps=args.max_off_policy_steps,
        workers=args.workers,
        timeout=args.timeout,
    )
    problems = (
        len(report.corrupt)
        + len(report.unreadable)
        + len(report.orphans)
        + len(report.stale_versions)
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return EXIT_PROBLEMS if problems else 0
    print(
        f"{printable(args.root)}: {count(report.files_checked, 'payload file')} checked "
        f"({format_bytes(report.bytes_checked)}), versions {report.versions or 'none'}"
    )
    for title, problems_of in (("corrupt", report.corrupt), ("unreadable", report.unreadable)):
        for name, message in problems_of.items():
            print(f"  {title:<10} {printable(name)}: {printable(message)}")
    for title, names in (
        ("orphan", report.orphans),
        ("temporary", report.temporary),
        ("headerless", report.headerless),
    ):
        for name in names:
            print(f"  {title:<10} {printable(name)}")
    if report.stale_versions:
        print(
            f"  stale      versions {report.stale_versions}: no batch after step {args.step} "
            f"may use them (at most {count(args.max_off_policy_steps, 'step')} off-policy); "
            f"'r3data gc' removes them"
        )
    if not problems:
        print("ok")
        return 0
    print(
        f"problems: {count(len(report.corrupt), 'corrupt file')}, "
        f"{count(len(report.unreadable), 'unreadable file')}, "
        f"{count(len(report.orphans), 'orphan')}, "
        f"{count(len(report.stale_versions), 'stale version')}"
    )
    return EXIT_PROBLEMS


def run_gc(args: argparse.Namespace) -> int:
    root = _root(args.root, args.timeout)
    report = gc(
        root.path,
        args.step,
        args.max_off_policy_steps,
        fs=root.fs,
        dry_run=args.dry_run,
        timeout=args.timeout,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return EXIT_PROBLEMS if report.errors else 0
    verb = "would remove" if report.dry_run else "removed"
    print(
        f"{printable(args.root)}: {verb} {count(len(report.files), 'file')} ({format_bytes(report.bytes)}) in "
        f"versions {report.versions or 'none'}; versions >= v{report.bound} are kept"
    )
    for name in report.files:
        print(f"  {printable(name)}")
    for message in report.errors:
        print(f"  error {printable(message)}")
    return EXIT_PROBLEMS if report.errors else 0
