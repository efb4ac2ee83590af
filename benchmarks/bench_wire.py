"""Decode a big routes response: ``load_packed_body`` vs the naive path vs the base64 floor.

The body is an OpenAI-style response with ``choices`` x ``tokens`` rows of uint8 routes per
choice (default 64 x 3,840 x 48 layers x top-8: ~90 MiB of routes in a ~120 MiB body), each
choice carrying an envelope with ``data`` first and some text (``--token-ids N`` adds N
completion token ids per choice, JSON that every path must parse).

Timed side by side in one run, interleaved, best of ``--repeats``:

- naive: ``orjson.loads`` + ``pybase64.b64decode`` + ``np.frombuffer`` per choice (what anyone
  would write), and ``naive_stdlib`` with the standard library's ``base64`` instead (the
  speedup target is against the pybase64 arm);
- floor: ``pybase64`` decoding each blob's bytes alone (cut out beforehand, untimed);
- ours: :func:`r3data.wire.load_packed_body`, and again with a second registered field
  (absent from the body) to show that a second field adds no second scan.

Peak extra memory of ``load_packed_body`` is measured with ``tracemalloc`` (every Python and
numpy allocation, the input body excluded) in a separate, untimed run. Targets: >= 6x faster
than naive, within 1.5x of the floor, peak extra memory <= 1.2x the decoded bytes.
"""

from __future__ import annotations

import argparse
import base64
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pybase64

from r3data.benchmarking import parse_report_args, time_interleaved, traced_peak_bytes, write_report
from r3data.wire import load_packed_body, pack_ndarray

TARGETS = {"speedup_vs_naive": 6.0, "ratio_to_floor": 1.5, "peak_extra_ratio": 1.2}
DEFAULT_OUT = Path(__file__).parent / "results" / "bench_wire.json"


def build_body(
    choices: int, tokens: int, layers: int, topk: int, token_ids: int = 0, seed: int = 0
) -> bytes:
    """A response body whose choices each carry a ``[tokens, layers, topk]`` uint8 envelope
    (and ``token_ids`` completion token ids, if asked)."""
    rng = np.random.default_rng(seed)
    parts = []
    for index in range(choices):
        routes = rng.integers(0, 128, size=(tokens, layers, topk), dtype=np.uint8)
        parts.append(
            {
                "index": index,
                "text": "The answer is 42. " * 8,
                "finish_reason": "stop",
                "token_ids": rng.integers(0, 151_000, size=token_ids).tolist(),
                "routed_experts": pack_ndarray(routes, start=0),
            }
        )
    return orjson.dumps({"id": "cmpl-bench", "object": "text_completion", "choices": parts})


def naive(raw: bytes, b64decode=pybase64.b64decode) -> list[np.ndarray]:
    """What anyone writes: parse the whole body, decode each blob (pybase64; the stdlib's
    ``base64`` for the second naive arm)."""
    body = orjson.loads(raw)
    return [
        np.frombuffer(b64decode(env["data"]), dtype=env["dtype"]).reshape(env["shape"])
        for env in (choice["routed_experts"] for choice in body["choices"])
    ]


def blob_views(raw: bytes) -> list[memoryview]:
    """The base64 blobs of ``raw``, cut out for the floor (not timed)."""
    view = memoryview(raw)
    return [view[m.start(1) : m.end(1)] for m in re.finditer(rb'"data":"([^"]*)"', raw)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small body, few repeats")
    parser.add_argument("--choices", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument(
        "--token-ids", type=int, default=0, help="completion token ids per choice (parse load)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    args = parse_report_args(parser, argv, DEFAULT_OUT)
    choices = args.choices or (4 if args.quick else 64)
    tokens = args.tokens or (256 if args.quick else 3840)
    repeats = args.repeats or (3 if args.quick else 11)

    raw = build_body(choices, tokens, args.layers, args.topk, args.token_ids)
    decoded_bytes = choices * tokens * args.layers * args.topk
    blobs = blob_views(raw)
    ours = load_packed_body(raw)
    for expected, choice in zip(naive(raw), ours["choices"], strict=True):
        np.testing.assert_array_equal(choice["routed_experts"]["data"], expected)
    del ours

    seconds = time_interleaved(
        {
            "naive": lambda: naive(raw),
            "naive_stdlib": lambda: naive(raw, base64.b64decode),
            "floor": lambda: [pybase64.b64decode(blob, validate=True) for blob in blobs],
            "ours": lambda: load_packed_body(raw),
            "ours_two_fields": lambda: load_packed_body(raw, ("routed_experts", "sampling_mask")),
        },
        repeats,
        freeze_heap=args.quick,
    )
    best = {name: min(values) for name, values in seconds.items()}
    peak = traced_peak_bytes(lambda: load_packed_body(raw))
    result = {
        "benchmark": "wire",
        "config": {
            "choices": choices,
            "tokens": tokens,
            "layers": args.layers,
            "topk": args.topk,
            "token_ids": args.token_ids,
            "repeats": repeats,
            "quick": args.quick,
        },
        "body_bytes": len(raw),
        "decoded_bytes": decoded_bytes,
        "seconds_best": best,
        "seconds_median": {name: statistics.median(v) for name, v in seconds.items()},
        "speedup_vs_naive": best["naive"] / best["ours"],
        "speedup_vs_naive_stdlib": best["naive_stdlib"] / best["ours"],
        "ratio_to_floor": best["ours"] / best["floor"],
        "second_field_ratio": best["ours_two_fields"] / best["ours"],
        "peak_extra_bytes": peak,
        "peak_extra_ratio": peak / decoded_bytes,
        "memory_method": "tracemalloc peak during load_packed_body (input body excluded)",
        "targets": TARGETS,
    }
    result["met"] = {
        "speedup_vs_naive": result["speedup_vs_naive"] >= TARGETS["speedup_vs_naive"],
        "ratio_to_floor": result["ratio_to_floor"] <= TARGETS["ratio_to_floor"],
        "peak_extra_ratio": result["peak_extra_ratio"] <= TARGETS["peak_extra_ratio"],
    }

    print(
        f"body {len(raw) / 2**20:.1f} MiB, routes {decoded_bytes / 2**20:.1f} MiB "
        f"({choices} choices x {tokens} tokens x {args.layers} x {args.topk}), best of {repeats}"
    )
    for name, value in best.items():
        print(f"  {name:<16} {value * 1e3:9.1f} ms")
    print(
        f"  speedup vs naive (pybase64) {result['speedup_vs_naive']:.2f}x (target >= 6; "
        f"{result['speedup_vs_naive_stdlib']:.2f}x vs stdlib base64), "
        f"ratio to floor {result['ratio_to_floor']:.2f}x (target <= 1.5), "
        f"second field {result['second_field_ratio']:.2f}x, "
        f"peak extra memory {result['peak_extra_ratio']:.2f}x decoded (target <= 1.2)"
    )
    write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
