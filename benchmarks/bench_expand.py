"""Expand one rank's routes: :func:`r3data.layout.expand` vs a one-pass widen of the same ids.

The batch holds ``--sequences`` samples (default 256, lengths uniform in [512, 4096]) of uint8
routes, 48 layers x top-8, packed back to back. One rank of a TP 2 x CP 2 grid with sequence
parallelism expands them into int32 per-layer tensors: the whole batch as one THD (packed)
micro-batch, and as BSHD (seq-major) micro-batches of ``--micro-batch`` sequences.

Timed side by side in one run, interleaved, median of ``--repeats``:

- widen: the baseline: uint8 ids as many as the output holds, widened to int32 in one pass
  into memory from the same allocator ``expand``'s output comes from (on the CPU numpy's,
  which gets transparent huge pages from 4 MiB where the kernel allows; on a GPU torch's),
  allocation included, as ``expand`` allocates its output too;
- widen on every CPU: the same widen cut into as many parts as the process may use CPUs
  (:func:`r3data.parallel.pool_workers`), copied side by side, as ``expand`` copies on the
  CPU (reported next to the target, which is the one-pass widen's);
- for reference: ``clone()`` of an int32 tensor the size of the output (it reads 4x the bytes
  of the uint8 input and, on the CPU, takes 4 KiB pages), ``copy_`` into a preallocated one,
  and a numpy copy;
- ours: ``expand(routes, layout)``.

Peak extra memory of ``expand`` (output included) is the process's resident high-water mark
above its resident size before the call (``/proc/self/clear_refs`` resets the mark) on the
CPU, or ``torch.cuda.max_memory_allocated`` on a GPU. Targets: >= 0.8x the widen's
throughput, THD and BSHD alike; peak extra memory <= 1.2x the output size.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from r3data.benchmarking import parse_report_args, time_interleaved, write_report
from r3data.layout import TokenLayout, expand
from r3data.packed import PackedTensor
from r3data.parallel import fill_rows, pool_workers

TARGETS = {"widen_throughput_ratio": 0.8, "peak_extra_ratio": 1.2}
DEFAULT_OUT = Path(__file__).parent / "results" / "bench_expand.json"
_M_MMAP_THRESHOLD = -3


def build_routes(
    sequences: int, min_len: int, max_len: int, layers: int, topk: int, device: str, seed: int = 0
) -> PackedTensor:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=sequences)
    values = torch.from_numpy(
        rng.integers(0, 128, size=(int(lengths.sum()), layers, topk), dtype=np.uint8)
    )
    return PackedTensor.from_lengths(values.to(device), lengths)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def pin_mmap_threshold(threshold: int = 1 << 17) -> None:
    """Make glibc map every block of ``threshold`` bytes or more on its own and unmap it on free.

    glibc otherwise raises the threshold after large frees and keeps freed blocks resident,
    which hides later allocations from the resident high-water mark.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def transparent_hugepage_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise``, ``never``), or None where unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def peak_extra_bytes(call: Callable[[], Any], device: torch.device) -> int | None:
    """Peak memory ``call`` adds (its result included), or None where it cannot be measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = call()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            before = _status_kib("VmRSS")
        except OSError:
            return None
        result = call()
        peak = (_status_kib("VmHWM") - before) * 1024
    del result
    return peak


def bench_layout(
    name: str, micro_batches: list[PackedTensor], layout: TokenLayout, repeats: int
) -> dict:
    """Expand every micro-batch for one rank vs copying the same output bytes."""
    device = micro_batches[0].device
    outputs = [expand(routes, layout) for routes in micro_batches]
    sizes = [sum(t.numel() * t.element_size() for t in per_layer) for per_layer in outputs]
    tokens = sum(per_layer[0].shape[0] for per_layer in outputs)
    del outputs
    output_bytes = sum(sizes)
    sources = [torch.ones(size // 4, dtype=torch.int32, device=device) for size in sizes]
    targets = [torch.empty_like(source) for source in sources]
    narrow = [torch.ones(size // 4, dtype=torch.uint8, device=device) for size in sizes]

    def widen(ids: torch.Tensor) -> Any:
        if device.type == "cpu":  # numpy's allocator, as expand's CPU output
            out = np.empty(ids.shape[0], np.int32)
            np.copyto(out, ids.numpy())
            return out
        return ids.to(torch.int32)

    def widen_threads(ids: torch.Tensor) -> Any:
        if device.type != "cpu":
            return ids.to(torch.int32)
        out = np.empty(ids.shape[0], np.int32)
        cuts = np.linspace(0, ids.shape[0], pool_workers() + 1).astype(np.int64).tolist()
        fill_rows(
            lambda i: np.copyto(out[cuts[i] : cuts[i + 1]], ids.numpy()[cuts[i] : cuts[i + 1]]),
            len(cuts) - 1,
        )
        return out

    def expand_all() -> list[list[torch.Tensor]]:
        return [expand(routes, layout) for routes in micro_batches]

    cases = {
        "widen": lambda: [widen(ids) for ids in narrow],
        "widen_threads": lambda: [widen_threads(ids) for ids in narrow],
        "clone": lambda: [source.clone() for source in sources],
        "copy_into": lambda: [t.copy_(s) for t, s in zip(targets, sources, strict=True)],
        "expand": expand_all,
    }
    if device.type == "cpu":
        cases["numpy_copy"] = lambda: [source.numpy().copy() for source in sources]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    seconds = time_interleaved(cases, repeats, sync=sync)
    median = {case: statistics.median(values) for case, values in seconds.items()}
    peak = peak_extra_bytes(expand_all, device)
    ratio = median["widen"] / median["expand"]
    peak_ratio = None if peak is None else peak / output_bytes
    return {
        "layout": name,
        "micro_batches": len(micro_batches),
        "local_tokens": tokens,
        "output_bytes": output_bytes,
        "seconds_median": median,
        "seconds_all": seconds,
        "expand_gib_per_s": output_bytes / median["expand"] / 2**30,
        "widen_throughput_ratio": ratio,
        "widen_threads": pool_workers() if device.type == "cpu" else None,
        "widen_threads_throughput_ratio": median["widen_threads"] / median["expand"],
        "clone_throughput_ratio": median["clone"] / median["expand"],
        "copy_into_throughput_ratio": median["copy_into"] / median["expand"],
        "numpy_copy_throughput_ratio": median["numpy_copy"] / median["expand"]
        if "numpy_copy" in median
        else None,
        "peak_extra_bytes": peak,
        "peak_extra_ratio": peak_ratio,
        "met": {
            "widen_throughput_ratio": ratio >= TARGETS["widen_throughput_ratio"],
            "peak_extra_ratio": peak_ratio is not None
            and peak_ratio <= TARGETS["peak_extra_ratio"],
        },
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, few repeats")
    parser.add_argument("--sequences", type=int, default=None)
    parser.add_argument("--min-len", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per BSHD micro-batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parse_report_args(parser, argv, DEFAULT_OUT)
    sequences = args.sequences or (16 if args.quick else 256)
    min_len = args.min_len or (64 if args.quick else 512)
    max_len = args.max_len or (256 if args.quick else 4096)
    repeats = args.repeats or (3 if args.quick else 7)

    pin_mmap_threshold()
    routes = build_routes(sequences, min_len, max_len, args.layers, args.topk, args.device)
    grid = {"tp_size": 2, "tp_rank": 1, "sequence_parallel": True, "cp_size": 2, "cp_rank": 0}
    bshd = [routes[i : i + args.micro_batch] for i in range(0, sequences, args.micro_batch)]
    results = [
        bench_layout("thd tp2 cp2 sp", [routes], TokenLayout(packed=True, **grid), repeats),
        bench_layout("bshd tp2 cp2 sp", bshd, TokenLayout(packed=False, **grid), repeats),
    ]
    result = {
        "benchmark": "expand",
        "config": {
            "sequences": sequences,
            "min_len": min_len,
            "max_len": max_len,
            "layers": args.layers,
            "topk": args.topk,
            "route_dtype": "uint8",
            "output_dtype": "int32",
            "bshd_micro_batch": args.micro_batch,
            "repeats": repeats,
            "device": args.device,
            "torch_threads": torch.get_num_threads(),
            "transparent_hugepage": transparent_hugepage_mode(),
            "quick": args.quick,
        },
        "batch_rows": routes.total_rows,
        "targets": TARGETS,
        "results": results,
        "met": all(all(r["met"].values()) for r in results),
    }
    for r in results:
        peak = "n/a" if r["peak_extra_ratio"] is None else f"{r['peak_extra_ratio']:.2f}x"
        numpy_copy = r["numpy_copy_throughput_ratio"]
        print(
            f"{r['layout']:>16}: {r['local_tokens']:>9} tokens, "
            f"{r['output_bytes'] / 2**20:8.1f} MiB, expand {r['expand_gib_per_s']:6.2f} GiB/s, "
            f"{r['widen_throughput_ratio']:.2f}x the one-pass widen "
            f"(target >= {TARGETS['widen_throughput_ratio']}), "
            f"{r['widen_threads_throughput_ratio']:.2f}x the widen on {r['widen_threads']} "
            "threads, "
            f"{r['clone_throughput_ratio']:.2f}x clone, {r['copy_into_throughput_ratio']:.2f}x copy_, "
            + ("" if numpy_copy is None else f"{numpy_copy:.2f}x numpy copy, ")
            + f"peak extra {peak} of output (target <= {TARGETS['peak_extra_ratio']})"
        )
    write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
