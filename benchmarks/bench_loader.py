"""One RL step end to end: ``r3data.loader`` against a hand-written loader and the bytes' floor.

The step is ``--rollouts`` Qwen3-30B-A3B rollouts from :mod:`r3data.synth` (ragged, multi-turn,
typical RL lengths), half served inline as vLLM and prime-rl response bodies, half by handle
(one payload file per request under a local root, page cache warm), one batch of all of them.

Timed side by side in one run, arms interleaved, best of ``--repeats``:

- ``loader``: :func:`r3data.loader` in steady state, as a training loop runs it: a loader
  over ``--batches`` steps with its default prefetch (the next batch is stitched while this one
  is filled), every batch dropped before the next (buffers recycled from a warm pool), the
  whole run timed, first batch included, and divided by the batches;
  ``loader_latency``: one batch with ``prefetch=0`` (nothing overlapped) from a running loader;
  ``loader_first``: a new loader's first batch (fresh buffers, page faults);
- ``naive``: what a trainer writes by hand, one thread: per request ``orjson.loads`` of the
  body, ``pybase64.b64decode`` of the blob, ``np.frombuffer`` after the ``.npy`` header or
  into the envelope's shape, ``np.fromfile`` of a by-handle segment, each copied into a zeroed
  ``torch`` ``[B, max_len, layers, topk]`` rectangle: ``naive_recycled`` zeroes one rectangle
  again each step (already faulted in, as the loader's pooled buffers are: the same allocator
  on both sides, the speedup target's baseline), ``naive`` allocates a fresh ``torch.zeros``
  each step (how it is usually written; its page faults vary with the machine's state);
- ``floor``: the bytes' own cost, one thread: every inline blob (cut out of its body
  beforehand, untimed) decoded with ``pybase64.b64decode`` and copied to its place in a warm
  batch-sized buffer, and every by-handle segment read with one ``readinto`` straight into its
  place there: the least work that puts the step's bytes where a batch holds them;
  ``decode_only``: the same decodes and reads into a small reused buffer (the bytes never
  leave the cache: a bound no loader can reach, reported for scale); ``memcpy``: one
  ``np.copyto`` of the same number of bytes into a warm buffer.

Also measured: the peak resident memory the loader's first batch adds, over the batch's route
bytes (``/proc/self`` high-water mark reset before it), and the fixed cost per sample:
``--tiny`` samples of 8 tokens, inline (vLLM bodies) and by handle, loader against a
hand-written ``orjson`` + ``pybase64`` (``np.fromfile``) loop, in microseconds per sample.

Targets: steady state <= 1.5x the floor; >= 10x faster than ``naive_recycled``; fixed cost <= 50 us per
sample, inline and by handle; first batch's peak memory <= 1.1x its route bytes.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pybase64
import torch

from r3data import loader
from r3data.benchmarking import parse_report_args, time_interleaved, write_report
from r3data.buffers import BufferPool
from r3data.payload import PayloadSegment, PayloadWriter
from r3data.synth import MODEL_SHAPES, SyntheticRouter, serve_rollouts, synth_rollouts
from r3data.synth.serve import vllm_response

TARGETS = {
    "loader_vs_floor": 1.5,
    "speedup_vs_naive": 10.0,
    "fixed_cost_us_inline": 50.0,
    "fixed_cost_us_by_handle": 50.0,
    "first_batch_peak_rss_vs_route_bytes": 1.1,
}
DEFAULT_OUT = Path(__file__).parent / "results" / "bench_loader.json"
_NPY_BLOB = re.compile(rb'"routed_experts":"([^"]*)"')
_ENVELOPE = re.compile(rb'"data":"([^"]*)"')


def _step(args: argparse.Namespace, root: str) -> tuple[list[dict[str, Any]], int, int]:
    shape = MODEL_SHAPES["qwen3-30b-a3b"]
    rollouts = synth_rollouts(SyntheticRouter(shape, seed=0), args.rollouts, seed=0)
    served = serve_rollouts(rollouts, producers=("vllm", "prime-rl"), writer=PayloadWriter(root))
    tokens = sum(r.tokens for r in rollouts)
    return served.samples, served.inline_route_bytes + served.handle_route_bytes, tokens


def _sources(samples: list[dict[str, Any]]) -> list[tuple[int, int, Any]]:
    """``(sample, request, source)`` of every request."""
    return [
        (i, j, source)
        for i, sample in enumerate(samples)
        for j, request in enumerate(sample["requests"])
        for source in request["sources"]
    ]


def naive_rectangle(samples: list[dict[str, Any]], row_shape: tuple[int, int]) -> torch.Tensor:
    max_len = max(len(s["token_ids"]) for s in samples)
    return torch.zeros((len(samples), max_len, *row_shape), dtype=torch.uint8)


def naive_step(
    samples: list[dict[str, Any]],
    root: str,
    row_shape: tuple[int, int],
    out: torch.Tensor | None = None,
) -> Any:
    """The hand-written loader: parse, decode, read and copy per request into a padded
    rectangle: a fresh ``torch.zeros``, or ``out`` zeroed again (a recycled one)."""
    out = naive_rectangle(samples, row_shape) if out is None else out.zero_()
    view = out.numpy()
    row_bytes = int(np.prod(row_shape))
    for i, _, source in _sources(samples):
        if "file" in source:  # by handle
            rows = np.fromfile(
                os.path.join(root, source["file"]),
                np.uint8,
                source["rows"] * row_bytes,
                offset=source["offset"],
            ).reshape(-1, *row_shape)
            pos = source["pos"]
        elif source["producer"] == "vllm":
            body = orjson.loads(source["response"])
            choice = body["choices"][0]
            raw = pybase64.b64decode(choice["routed_experts"])
            rows = np.load(io.BytesIO(raw), allow_pickle=False)
            pos = source.get("start", 0)
        else:  # prime-rl envelope
            body = orjson.loads(source["response"])
            envelope = body["choices"][0]["routed_experts"]
            rows = np.frombuffer(pybase64.b64decode(envelope["data"]), np.uint8)
            rows = rows.reshape(envelope["shape"])
            pos = envelope["start"]
        view[i, pos : pos + len(rows)] = rows
    return out


def floor_parts(
    samples: list[dict[str, Any]], root: str
) -> tuple[list[bytes], list[tuple[str, int, int]]]:
    """The inline blobs cut out of their bodies, and the by-handle byte ranges."""
    blobs, ranges = [], []
    for _, _, source in _sources(samples):
        if "file" in source:
            segment = PayloadSegment.from_dict(source)
            ranges.append((os.path.join(root, segment.file), segment.offset, segment.nbytes))
        else:
            pattern = _NPY_BLOB if source["producer"] == "vllm" else _ENVELOPE
            blobs.append(pattern.search(source["response"]).group(1))
    return blobs, ranges


def floor_step(
    blobs: list[bytes], ranges: list[tuple[str, int, int]], buffer: np.ndarray, *, place: bool
) -> int:
    """One thread: decode every blob and read every range, each to its own place in ``buffer``
    (``place``), or all into its start (the bytes stay in cache)."""
    cursor = 0
    for blob in blobs:
        decoded = pybase64.b64decode(blob, validate=True)
        at = cursor if place else 0
        np.copyto(buffer[at : at + len(decoded)], np.frombuffer(decoded, np.uint8))
        cursor += len(decoded)
    view = memoryview(buffer)
    for path, offset, nbytes in ranges:
        at = cursor if place else 0
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(view[at : at + nbytes])
        cursor += nbytes
    return cursor


def _rss_peak_extra(call) -> int:
    """Peak resident bytes ``call`` adds (Linux: the high-water mark, reset before the call)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    result = call()
    peak = _status("VmHWM")
    del result
    return peak - before


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def tiny_samples(count: int, root: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``count`` samples of 8 tokens (7 route rows), inline vLLM bodies and by handle."""
    rng = np.random.default_rng(1)
    writer = PayloadWriter(root)
    inline, by_handle = [], []
    for i in range(count):
        rows = rng.integers(0, 128, (7, 48, 8), dtype=np.uint8)
        body = vllm_response(rows, prompt_ids=list(range(4)), completion_ids=list(range(4)))
        source = {"producer": "vllm", "response": body}
        inline.append(_tiny(f"i{i}", source))
        by_handle.append(_tiny(f"h{i}", writer.write(0, {"routed_experts": rows})[0].to_dict()))
    return inline, by_handle


def _tiny(sample_id: str, source: Any) -> dict[str, Any]:
    request = {"prompt_len": 4, "completion_len": 4, "sources": [source]}
    return {"id": sample_id, "token_ids": np.arange(8), "requests": [request]}


def hand_written_tiny(samples: list[dict[str, Any]], root: str, batch: int) -> int:
    """The fixed cost floor a person writes: parse or read each sample, copy it into a batch."""
    out = np.zeros((batch, 8, 48, 8), np.uint8)
    for k, sample in enumerate(samples):
        source = sample["requests"][0]["sources"][0]
        if "file" in source:
            rows = np.fromfile(
                os.path.join(root, source["file"]), np.uint8, 7 * 384, offset=source["offset"]
            )
        else:
            body = orjson.loads(source["response"])
            raw = pybase64.b64decode(body["choices"][0]["routed_experts"])
            rows = np.load(io.BytesIO(raw), allow_pickle=False)
        out[k % batch, :7] = rows.reshape(7, 48, 8)
    return len(samples)


def _drain_step(samples: list[dict[str, Any]], options: dict[str, Any]) -> int:
    """Run a loader to its end as a training loop does: each batch dropped before the next."""
    count = 0
    for batch in loader(samples, **options):
        count += batch.batch_size
        del batch
    return count


def _drain(samples: list[dict[str, Any]], root: str, batch: int) -> int:
    count = 0
    for b in loader(samples, batch_size=batch, payload_root=root, prefetch=0, num_experts=128):
        count += b.batch_size
        del b
    return count


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--tiny", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=6, help="steps in the steady-state run")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parse_report_args(parser, argv, DEFAULT_OUT)
    if args.quick:
        args.rollouts, args.tiny, args.repeats, args.batches = 16, 64, 1, 2
    row_shape = (48, 8)
    with tempfile.TemporaryDirectory(prefix="r3data-bench-loader-") as root:
        samples, route_bytes, tokens = _step(args, root)
        options = {"batch_size": len(samples), "payload_root": root, "prefetch": 0}
        options["num_experts"] = MODEL_SHAPES["qwen3-30b-a3b"].num_experts
        peak = _rss_peak_extra(lambda: next(iter(loader(samples, **options))))
        latency = iter(loader(samples * (2 * args.repeats + 2), **options))
        del next(latency)["routed_experts"]  # the first batch, faults and all, out of the way
        pool = BufferPool()
        run_options = {**options, "prefetch": 2, "collate": {"buffer_pool": pool}}
        _drain_step(samples * args.batches, run_options)  # the pool's buffers faulted in
        blobs, ranges = floor_parts(samples, root)
        warm = np.ones(route_bytes + sum(len(b) for b in blobs), np.uint8)
        source = np.ones(route_bytes, np.uint8)
        target = np.ones(route_bytes, np.uint8)
        rectangle = naive_rectangle(samples, row_shape).fill_(1)  # faulted in, as the pool's
        seconds = time_interleaved(
            {
                "loader": lambda: _drain_step(samples * args.batches, run_options),
                "loader_latency": lambda: next(latency),
                "loader_first": lambda: next(iter(loader(samples, **options))),
                "naive": lambda: naive_step(samples, root, row_shape),
                "naive_recycled": lambda: naive_step(samples, root, row_shape, rectangle),
                "floor": lambda: floor_step(blobs, ranges, warm, place=True),
                "decode_only": lambda: floor_step(blobs, ranges, warm, place=False),
                "memcpy": lambda: np.copyto(target, source),
            },
            args.repeats,
            freeze_heap=args.quick,
        )
        times = {arm: min(runs) for arm, runs in seconds.items()}
        times["loader"] /= args.batches
        inline, by_handle = tiny_samples(args.tiny, root)
        batch = min(256, args.tiny)
        tiny = time_interleaved(
            {
                "loader_inline": lambda: _drain(inline, root, batch),
                "loader_by_handle": lambda: _drain(by_handle, root, batch),
                "hand_written_inline": lambda: hand_written_tiny(inline, root, batch),
                "hand_written_by_handle": lambda: hand_written_tiny(by_handle, root, batch),
            },
            max(1, args.repeats // 2),
            freeze_heap=args.quick,
        )
    per_sample = {arm: min(runs) / args.tiny * 1e6 for arm, runs in tiny.items()}
    ratios = {
        "loader_vs_floor": times["loader"] / times["floor"],
        "speedup_vs_naive": times["naive_recycled"] / times["loader"],
        "fixed_cost_us_inline": per_sample["loader_inline"],
        "fixed_cost_us_by_handle": per_sample["loader_by_handle"],
        "first_batch_peak_rss_vs_route_bytes": peak / route_bytes,
    }
    report = {
        "benchmark": "loader",
        "quick": args.quick,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "route_bytes": route_bytes,
        "tokens": tokens,
        "seconds": times,
        "tokens_per_second": tokens / times["loader"],
        "gbps": {arm: route_bytes / t / 1e9 for arm, t in times.items()},
        "speedup_vs_naive_fresh": times["naive"] / times["loader"],
        "loader_vs_memcpy": times["loader"] / times["memcpy"],
        "loader_latency_vs_floor": times["loader_latency"] / times["floor"],
        "loader_first_vs_floor": times["loader_first"] / times["floor"],
        "first_batch_peak_rss_bytes": peak,
        "fixed_cost_us": per_sample,
        **ratios,
        "targets": TARGETS,
        "met": {
            name: ratios[name] >= target if name == "speedup_vs_naive" else ratios[name] <= target
            for name, target in TARGETS.items()
        },
    }
    write_report(report, args.out)
    print(
        f"step of {args.rollouts} rollouts, {route_bytes / 1e6:.0f} MB of routes: loader "
        f"{times['loader']:.3f}s ({ratios['loader_vs_floor']:.2f}x floor {times['floor']:.3f}s, "
        f"{ratios['speedup_vs_naive']:.1f}x faster than naive on a recycled rectangle "
        f"{times['naive_recycled']:.3f}s ({report['speedup_vs_naive_fresh']:.1f}x on fresh "
        f"torch.zeros {times['naive']:.3f}s), "
        f"{report['loader_vs_memcpy']:.1f}x memcpy), one batch alone "
        f"{times['loader_latency']:.3f}s, first batch {times['loader_first']:.3f}s, "
        f"peak RSS {ratios['first_batch_peak_rss_vs_route_bytes']:.2f}x route bytes"
    )
    print(
        "fixed cost per sample: "
        + ", ".join(f"{arm} {us:.1f} us" for arm, us in per_sample.items())
    )
    print(f"targets {TARGETS}: met {report['met']}")
    return report


if __name__ == "__main__":
    main()
