"""``r3data inspect``: what a payload file, a payload directory or a JSON response holds."""

from __future__ import annotations

import argparse
import json
import posixpath
from dataclasses import replace
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem

from r3data.cli.common import (
    EXIT_PROBLEMS,
    count,
    format_bytes,
    fs_call,
    int_at_least,
    printable,
    render_table,
    resolve,
)
from r3data.cli.histogram import load_summary, render_histogram
from r3data.cli.payload import timeout_argument
from r3data.errors import ConfigError, PayloadError, PayloadFormatError, WireFormatError
from r3data.nodes.screen import ScreenOptions, dense_layers, screen_rows
from r3data.parallel import fill_rows, io_workers
from r3data.payload import MAGIC, PayloadFile, PayloadFileInfo, PayloadReader, PayloadSegment
from r3data.payload.fileformat import HEADER_READ_BYTES, read_header, starts_like_payload
from r3data.payload.fs import open_file
from r3data.payload.reader import CHUNK_BYTES
from r3data.synth import MODEL_SHAPES
from r3data.wire import RowSource
from r3data.wire.producers import FORMATS, Lengths, ProducerFormat, detect, producer_format
from r3data.wire.producers.base import ROUTES_FIELD, option_names
from r3data.wire.producers.common import is_stream

SNIFF_BYTES = 4096
"""Bytes read to tell a payload file from a response: JSON and event streams may open with
whitespace."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect",
        help="show what a payload file, payload directory or JSON response holds",
        description="Show the fields, segments, shapes and dtypes of a payload file, of every "
        "payload file under a directory, or of an inference server's JSON response (vLLM, "
        "SGLang, prime-rl, SkyRL, NeMo-RL, any format version of the producer registry, "
        "streams included; the format is detected), followed by a histogram of the expert "
        "load its routes put on each expert. PATH is a local path or an fsspec URL.",
    )
    parser.add_argument("path", metavar="PATH", help="payload file, directory, or JSON response")
    parser.add_argument(
        "--producer",
        choices=sorted(FORMATS),
        help="read a JSON response as this producer format's (default: detected)",
    )
    parser.add_argument(
        "--start",
        type=int_at_least(0),
        help="the request's prompt start (vLLM routed_experts_prompt_start, SGLang "
        "routed_experts_start_len), which no producer echoes (default 0)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int_at_least(0),
        help="the request's prompt length, for bodies without prompt ids (prime-rl, SkyRL): "
        "places sampling masks and checks route rows",
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        help="layers and top-k for SGLang's flat routes, and the expert count",
    )
    parser.add_argument("--num-layers", type=int_at_least(1), help="SGLang: decoder layers")
    parser.add_argument("--topk", type=int_at_least(1), help="SGLang: experts per token")
    parser.add_argument(
        "--max-files",
        type=int_at_least(0),
        default=64,
        help="directory: read the routes of at most this many files for the histogram (default 64)",
    )
    timeout_argument(parser, "a look-up, a listing or a ranged read")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fs, path = resolve(args.path, timeout=args.timeout)
    if fs_call(fs, args.timeout, "isdir", path):
        report = _directory(fs, path, args)
    else:
        with open_file(path, fs, timeout=args.timeout) as f:  # refuses a FIFO or device
            head = _read(f, SNIFF_BYTES)
            payload = head[: len(MAGIC)] == MAGIC
            response = not payload and (head.lstrip()[:1] in (b"{", b"[") or is_stream(head))
            body = _read(f, f.size) if response else b""
        if payload:
            report = _payload_file(fs, path, args)
        elif response:
            report = _response(body, args)
        else:
            raise PayloadFormatError(
                f"{args.path}: expected a payload file (starting with {MAGIC!r}), a JSON "
                f"response or a stream of them, found {head[: len(MAGIC)]!r}"
            )
    if args.json:
        print(json.dumps(report, indent=2, default=_json_default))
    else:
        print(_render(report))
    return EXIT_PROBLEMS if report.get("corrupt") else 0


def _read(f: PayloadFile, nbytes: int) -> bytes:
    """The first ``nbytes`` of ``f`` (fewer at its end), read :data:`CHUNK_BYTES` at a time:
    on a filesystem that is not local-backed each read is given up after the file's timeout."""
    data = bytearray(nbytes)
    view, done = memoryview(data), 0
    while done < nbytes:
        got = f.read_at(done, view[done : done + CHUNK_BYTES])
        if not got:
            break
        done += got
    return view[:done].tobytes()


def _header(fs: AbstractFileSystem, path: str, timeout: float | None) -> PayloadFileInfo:
    """:func:`r3data.payload.inspect` of ``path``, each call bounded by ``timeout``."""
    with open_file(path, fs, timeout=timeout) as f:
        return PayloadFileInfo(path, f.size, read_header(f.stream(HEADER_READ_BYTES), path))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


# --- payload files ---------------------------------------------------------------------------


def _is_routes(segment: PayloadSegment) -> bool:
    return not segment.ragged and len(segment.shape) == 2 and np.dtype(segment.dtype).kind in "iu"


def _read_routes(
    fs: AbstractFileSystem, path: str, segments: list[PayloadSegment], timeout: float | None
) -> list[np.ndarray]:
    """The rows of every route-like field of the payload file at ``path`` that the loader's
    screen keeps (see :func:`_kept`)."""
    reader = PayloadReader(posixpath.dirname(path) or ".", fs=fs, timeout=timeout)
    wanted = [replace(s, file=posixpath.basename(path)) for s in segments if _is_routes(s)]
    return [_kept(reader.read([s])[s.field]) for s in wanted]


def _experts(args: argparse.Namespace) -> int | None:
    """The expert count ``--model-shape`` gives (None: the largest id seen, plus one)."""
    return MODEL_SHAPES[args.model_shape].num_experts if args.model_shape else None


def _payload_file(fs: AbstractFileSystem, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """The header of the payload file at ``path`` and the expert load of its routes; a header
    or routes that fail their checks make it corrupt (as in a directory), not an error."""
    report: dict[str, Any] = {"kind": "payload file", "path": args.path, "corrupt": {}}
    try:
        info = _header(fs, path, args.timeout)
    except PayloadFormatError as exc:
        return {**report, "corrupt": {args.path: str(exc)}, "expert_load": None}
    report.update(
        size=info.size,
        format_version=info.header.format_version,
        version=info.header.version,
        fields=[{**e.segment.to_dict(), "nbytes": e.nbytes} for e in info.header.fields],
        expert_load=None,
    )
    try:
        routes = _read_routes(fs, path, info.header.segments(), args.timeout)
    except PayloadError as exc:
        report["corrupt"][args.path] = str(exc)
    else:
        report["expert_load"] = load_summary(routes, _experts(args))
    return report


def _starts_like_payload(fs: AbstractFileSystem, path: str, timeout: float | None) -> bool:
    """Whether the file at ``path`` starts like a payload file (False: unreadable now)."""
    try:
        with open_file(path, fs, timeout=timeout) as f:
            return starts_like_payload(_read(f, len(MAGIC)))
    except PayloadError:
        return False


def _directory(fs: AbstractFileSystem, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every file under ``path``: payload files (their headers; the routes of the first
    ``--max-files`` read, checksums checked, for the expert load), corrupt ones with what is
    wrong (a header, or routes read, that fail their checks), and the other files."""
    names = sorted(fs_call(fs, args.timeout, "find", path))

    def header(i: int) -> dict[str, Any]:
        try:
            info = _header(fs, names[i], args.timeout)
        except PayloadFormatError as exc:
            corrupt = _starts_like_payload(fs, names[i], args.timeout)
            return {"file": names[i], "corrupt" if corrupt else "error": str(exc)}
        except PayloadError as exc:
            return {"file": names[i], "error": str(exc)}
        return {"file": names[i], "info": info}

    found = fill_rows(header, len(names), io_workers())
    files, others, corrupt, routes = [], [], {}, []
    for entry in found:
        name = posixpath.relpath(entry["file"], path)
        if "error" in entry:
            others.append({"file": name, "error": entry["error"]})
            continue
        if "corrupt" in entry:
            corrupt[name] = entry["corrupt"].removeprefix(f"{entry['file']}: ")
            continue
        info = entry["info"]
        files.append(
            {
                "file": name,
                "version": info.header.version,
                "size": info.size,
                "fields": [{**e.segment.to_dict(), "nbytes": e.nbytes} for e in info.header.fields],
            }
        )
        if len(files) <= args.max_files:
            try:
                routes += _read_routes(fs, entry["file"], info.header.segments(), args.timeout)
            except PayloadError as exc:
                corrupt[name] = str(exc).removeprefix(f"{entry['file']}: ")
    return {
        "kind": "payload directory",
        "path": args.path,
        "files": files,
        "corrupt": dict(sorted(corrupt.items())),
        "not_payload_files": others,
        "bytes": sum(f["size"] for f in files),
        "versions": sorted({f["version"] for f in files}),
        "expert_load_files": min(len(files), args.max_files),
        "expert_load": load_summary(routes, _experts(args)),
    }


# --- responses -------------------------------------------------------------------------------


def _sglang_shape(args: argparse.Namespace) -> dict[str, int]:
    if args.num_layers and args.topk:
        return {"num_layers": args.num_layers, "topk": args.topk}
    if args.model_shape:
        shape = MODEL_SHAPES[args.model_shape]
        return {"num_layers": shape.num_layers, "topk": shape.topk}
    raise ConfigError(
        "SGLang routes are flat int32 ids: pass --model-shape, or --num-layers and --topk"
    )


def _options(entry: ProducerFormat, args: argparse.Namespace) -> Any:
    names = option_names(entry.options)
    values: dict[str, Any] = {}
    if "num_layers" in names:
        values.update(_sglang_shape(args))
    if "start" in names and args.start is not None:
        values["start"] = args.start
    return entry.make_options(values)


def _rows_summary(rows: RowSource) -> dict[str, Any]:
    summary = {
        "field": rows.field,
        "pos": rows.pos,
        "end": rows.end,
        "rows": rows.rows,
        "row_shape": list(rows.row_shape),
        "dtype": rows.dtype.name,
        "nbytes": rows.nbytes,
        **rows.meta,
    }
    if rows.ragged:
        lengths = rows.array.lengths
        summary["widest"] = rows.array.widest
        summary["rows_without_ids"] = int((lengths == 0).sum())  # masks: no mask there
    else:
        summary["dense_layers"] = list(dense_layers(rows.array))
    return summary


def _screened(rows: RowSource) -> list[str]:
    """What the loader's screen would find missing in decoded routes, in words."""
    flags = screen_rows(rows.array, ScreenOptions())
    what = getattr(rows, "what", f"field {rows.field!r}")
    found = []
    if flags.zero is not None:
        zero = int(flags.zero.sum())
        scope = f"all {zero}" if zero == rows.rows else f"{zero} of {rows.rows}"
        found.append(
            f"{what}: {scope} route rows are zero in every layer (a known engine bug); the "
            f"loader treats them as missing"
        )
    if flags.negative is not None:
        found.append(
            f"{what}: {int(flags.negative.sum())} route rows hold negative ids (no route); "
            f"the loader treats them as missing"
        )
    return found


def _replayable(rows: RowSource) -> np.ndarray:
    """The route rows the loader would keep."""
    return _kept(rows.array)


def _kept(array: np.ndarray) -> np.ndarray:
    """The route rows of ``array`` the loader's screen keeps: none zero in every entry (the
    engine bug), none holding a negative id (-1 is no route)."""
    if not array.size:
        return array
    flags = screen_rows(np.ascontiguousarray(array), ScreenOptions())
    missing = [f for f in (flags.zero, flags.negative) if f is not None]
    return array[~np.logical_or.reduce(missing)] if missing else array


def _fields(raw: bytes, matches: list[ProducerFormat], args: argparse.Namespace):
    """Per field, the sources of the first matching format that has it; errors of the
    others' side fields (a mask without the prompt length) as notes."""
    lengths = Lengths(args.prompt_len, None)
    found: dict[str, list[Any]] = {}
    missing: list[str] = []
    notes: list[str] = []
    for rank, entry in enumerate(matches):
        options = _options(entry, args)
        for field in entry.fields:
            if field in found:
                continue
            try:
                choices = entry.decode(raw, options, lengths, frozenset({field}))
            except WireFormatError as exc:
                if rank == 0 and field == entry.fields[0]:
                    raise
                notes.append(f"{entry.name} {field}: {exc}")
                continue
            sources = [s for c in choices for s in c.sources]
            if sources:
                found[field] = sources
            if field == entry.fields[0] and rank == 0:
                missing += [m for c in choices for m in c.missing]
    return found, missing, notes


def _response(raw: bytes, args: argparse.Namespace) -> dict[str, Any]:
    matches = [producer_format(args.producer)] if args.producer else detect(raw)
    if not matches:
        raise WireFormatError(
            f"cannot tell which producer wrote this response (no format of {sorted(FORMATS)} "
            f"recognises it); pass --producer"
        )
    found, missing, notes = _fields(raw, matches, args)
    sources = [s for field_sources in found.values() for s in field_sources]
    routes = [s for s in sources if not isinstance(s, PayloadSegment) and s.field == ROUTES_FIELD]
    others = [s for s in sources if not isinstance(s, PayloadSegment) and s.field != ROUTES_FIELD]
    return {
        "kind": "response",
        "path": args.path,
        "producer": matches[0].name,
        "formats": [m.name for m in matches],
        "body_bytes": len(raw),
        "routes": [_rows_summary(r) for r in routes],
        "handles": [s.to_dict() for s in sources if isinstance(s, PayloadSegment)],
        "side_fields": [_rows_summary(r) for r in others],
        "missing": missing,
        "notes": notes,
        "warnings": [w for r in routes for w in _screened(r)],
        "expert_load": load_summary([_replayable(r) for r in routes], _experts(args)),
    }


# --- text ------------------------------------------------------------------------------------


def _field_rows(fields: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            printable(f["field"]),
            f"{f['pos']:,}",
            f"{f['rows']:,}",
            f["dtype"],
            "ragged" if f.get("index") is not None else str(f["shape"]),
            f"{f['offset']:,}",
            format_bytes(f["nbytes"]),
            f"{f['crc32c']:#010x}" if f.get("crc32c") is not None else "-",
        ]
        for f in fields
    ]


FIELD_HEADERS = ("field", "pos", "rows", "dtype", "row shape", "offset", "bytes", "crc32c")


def _render_file(report: dict[str, Any]) -> list[str]:
    if "fields" in report:
        lines = [
            f"{printable(report['path'])}: payload file (format {report['format_version']}), "
            f"policy version {report['version']}, {format_bytes(report['size'])}",
            render_table(_field_rows(report["fields"]), FIELD_HEADERS),
        ]
    else:  # its header failed its checks
        lines = [f"{printable(report['path'])}: payload file, corrupt"]
    return lines + _corrupt_lines(report)


def _corrupt_lines(report: dict[str, Any]) -> list[str]:
    return [
        f"  corrupt    {printable(name)}: {printable(message)}"
        for name, message in report["corrupt"].items()
    ]


def _render_directory(report: dict[str, Any]) -> list[str]:
    rows = [
        [
            printable(f["file"]),
            f"v{f['version']}",
            format_bytes(f["size"]),
            ", ".join(
                f"{printable(e['field'])} {e['rows']:,} x {e['shape'] or 'ragged'} {e['dtype']}"
                for e in f["fields"]
            ),
        ]
        for f in report["files"]
    ]
    return [
        f"{printable(report['path'])}: {count(len(report['files']), 'payload file')} "
        f"({format_bytes(report['bytes'])}), versions {report['versions'] or 'none'}",
        render_table(rows, ("file", "version", "size", "fields")),
        *_corrupt_lines(report),
        *[
            f"  not a payload file: {printable(other['file'])}"
            for other in report["not_payload_files"]
        ],
    ]


def _render_response(report: dict[str, Any]) -> list[str]:
    lines = [
        f"{printable(report['path'])}: {report['producer']} response, "
        f"{format_bytes(report['body_bytes'])}"
        + (f" (also read as {', '.join(report['formats'][1:])})" if report["formats"][1:] else "")
    ]
    rows = [
        [
            r["field"],
            r.get("choice", r.get("index", r.get("where", ""))),
            f"[{r['pos']:,}, {r['end']:,})",
            f"{r['rows']:,}",
            str(r["row_shape"]),
            r["dtype"],
            str(r.get("dense_layers", "")),
        ]
        for r in report["routes"]
    ]
    if rows:
        headers = ("field", "choice", "positions", "rows", "row shape", "dtype", "dense layers")
        lines.append(render_table(rows, headers))
    for handle in report["handles"]:
        lines.append(
            f"  by handle: {printable(handle['field'])} rows [{handle['pos']:,}, "
            f"{handle['pos'] + handle['rows']:,}) in {printable(handle['file'])} at offset "
            f"{handle['offset']:,}"
        )
    for side in report["side_fields"]:
        lines.append(
            f"  {side['field']}: {side['rows']:,} rows from position {side['pos']:,}, widest "
            f"{side.get('widest', '-')}, {side.get('rows_without_ids', 0):,} without ids"
        )
    lines += [f"  missing: {printable(m)}" for m in report["missing"]]
    lines += [f"  note: {printable(n)}" for n in report["notes"]]
    return lines + [f"  warning: {printable(w)}" for w in report["warnings"]]


RENDERERS = {
    "payload file": _render_file,
    "payload directory": _render_directory,
    "response": _render_response,
}


def _render(report: dict[str, Any]) -> str:
    lines = RENDERERS[report["kind"]](report)
    if report["expert_load"] is not None:
        lines += render_histogram(report["expert_load"])
    if report.get("corrupt"):
        lines.append(f"problems: {count(len(report['corrupt']), 'corrupt file')}")
    return "\n".join(lines)
