"""What every command shares: one-line usage errors, paths, progress bars, tables and sizes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import fsspec
from fsspec import AbstractFileSystem
from tqdm import tqdm

from r3data.errors import ConfigError, PayloadNotFoundError

__all__ = [
    "CommandParser",
    "error_line",
    "count",
    "format_bytes",
    "fs_call",
    "int_at_least",
    "printable",
    "progress",
    "render_table",
    "resolve",
]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def printable(text: object) -> str:
    """``text`` safe to print: a name from a listing or a file header may hold a newline (that
    would fake a line of the report), a terminal escape, or bytes that are not UTF-8 (which a
    UTF-8 terminal refuses to print); each such character is shown as its escape."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


EXIT_PROBLEMS = 1
"""A command ran but found problems (corrupt files, missed targets)."""

REMOTE_TRACEBACK = "Traceback (most recent call last)"


def error_line(exc: BaseException) -> str:
    """``r3data: error: <message>`` on one line.

    An error re-raised from a worker thread (torch's ``ExceptionWrapper``, as torchdata's
    nodes use) carries the worker's traceback in its message: only its last line is kept.
    """
    message = str(exc) or type(exc).__name__
    if REMOTE_TRACEBACK in message:
        last = message.strip().splitlines()[-1]
        message = last.split(": ", 1)[-1]
    return f"r3data: error: {printable(_one_line(message))}"


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        print(
            f"{self.prog}: error: {_one_line(message)} (see '{self.prog} --help')",
            file=sys.stderr,
        )
        raise SystemExit(2)


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, found {value}")
        return value

    return parse


def fs_call(
    fs: AbstractFileSystem, timeout: float | None, method: str, path: str, *args: Any
) -> Any:
    """``fs.<method>(path, *args)``; on a filesystem that is not local-backed given up after
    ``timeout`` seconds (None: no limit) as :class:`~r3data.errors.PayloadReadError` naming
    the call, as :meth:`~r3data.payload.PayloadRoot.call` does."""
    # imported here: r3data.payload imports torch, which ``r3data --help`` must not
    from r3data.payload.deadline import bounded
    from r3data.payload.fs import local_path

    if local_path(fs, path) is not None:
        return getattr(fs, method)(path, *args)
    return bounded(fs, timeout, f"{method} of {fs.unstrip_protocol(path)}", method, path, *args)


def resolve(
    path: str, *, timeout: float | None, want: str | None = None
) -> tuple[AbstractFileSystem, str]:
    """``(filesystem, path inside it)`` for a local path or fsspec URL that exists.

    ``want="dir"`` or ``"file"`` also requires that kind. A missing path raises
    :class:`PayloadNotFoundError`; an unknown protocol :class:`ConfigError`; a look-up past
    ``timeout`` on a filesystem that is not local-backed :class:`PayloadReadError`
    (:func:`fs_call`).
    """
    try:
        fs, inner = fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot open {path!r}: {exc}") from None
    if not fs_call(fs, timeout, "exists", inner):
        raise PayloadNotFoundError(f"{path}: no such file or directory")
    if want == "dir" and not fs_call(fs, timeout, "isdir", inner):
        raise ConfigError(f"{path}: expected a directory (a payload root), found a file")
    if want == "file" and fs_call(fs, timeout, "isdir", inner):
        raise ConfigError(f"{path}: expected a file, found a directory")
    return fs, inner


def progress(items: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """A tqdm bar on stderr when it is a terminal; the items unchanged otherwise."""
    return tqdm(items, desc=desc, total=total, disable=None, leave=False, file=sys.stderr)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``3 files``, ``1,204 rows``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def format_bytes(n: float) -> str:
    """``1.5 MiB``-style sizes (binary units)."""
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:,.1f} {unit}"
    return f"{n / 1024:,.1f} TiB"


def render_table(rows: Sequence[Sequence[Any]], headers: Sequence[str] | None = None) -> str:
    """Rows as left-aligned columns separated by two spaces (a rule under the headers)."""
    cells = [[str(c) for c in row] for row in ([headers] if headers else []) + list(rows)]
    if not cells:
        return ""
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    if headers:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
