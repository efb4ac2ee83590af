"""Read payload files by handle: ``read_into`` vs one sequential read, and concurrency under latency.

``--files`` payload files of Qwen3-30B-A3B-shaped routes (``[rows, 48, 8]`` uint8; rows drawn
from a heavy-tailed Pareto distribution, ~250 MB in all by default) are written with
:class:`r3data.payload.PayloadWriter` to a local temporary directory (page cache warm).

Timed side by side in one run, interleaved, best of ``--repeats``:

- ours: :meth:`PayloadReader.read_into` of every file's segment into one fresh batch buffer
  (checksums verified), and again with the checksums stripped from the segments;
- floor: the best sequential read of the same bytes: one file holding them all, read with
  ``os.preadv`` in as many contiguous parts, on as many threads, as this process may use CPUs
  (:func:`r3data.parallel.pool_workers`), into a fresh buffer from the same allocator;
- latency: a filesystem that is not local-backed (so every read goes through fsspec), adding
  ``--latency-ms`` per open and per read, read serially (``workers=1``) and concurrently
  (default workers, :func:`r3data.parallel.io_workers`).

Targets: ours within 1.2x of the floor; concurrency cuts the latency arm's wall time >= 5x.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from r3data.benchmarking import parse_report_args, time_interleaved, write_report
from r3data.parallel import fill_rows, io_workers, pool_workers
from r3data.payload import PayloadReader, PayloadSegment, PayloadWriter

TARGETS = {"ratio_to_floor": 1.2, "concurrency_speedup": 5.0}
DEFAULT_OUT = Path(__file__).parent / "results" / "bench_payload.json"
ROW_SHAPE = (48, 8)


class _SlowFile(io.RawIOBase):
    """A local file whose every read waits ``latency`` seconds first."""

    def __init__(self, f: Any, latency: float) -> None:
        self.f, self.latency = f, latency

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def readinto(self, buffer: Any) -> int:
        time.sleep(self.latency)
        return self.f.readinto(buffer)

    def close(self) -> None:
        self.f.close()
        super().close()


class LatencyFileSystem(AbstractFileSystem):
    """Local files behind a network-like delay on every open and every read; not a
    ``LocalFileSystem`` (nor local-backed), so readers go through fsspec as over a network."""

    protocol = "r3latency"

    def __init__(self, latency: float) -> None:
        super().__init__(skip_instance_cache=True)
        self.latency = latency
        self.local = LocalFileSystem()

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.local.info(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        time.sleep(self.latency)
        return _SlowFile(open(path, mode), self.latency)


def heavy_tailed_lengths(files: int, total_rows: int, rng: np.random.Generator) -> np.ndarray:
    """``files`` lengths >= 1 from a Pareto(1.5) tail, scaled to sum to about ``total_rows``."""
    draws = rng.pareto(1.5, files) + 1.0
    return np.maximum(1, np.round(draws / draws.sum() * total_rows)).astype(np.int64)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few small files, few repeats")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--total-mb", type=float, default=None, help="routes written, in MB")
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=None)
    args = parse_report_args(parser, argv, DEFAULT_OUT)
    files = args.files or (32 if args.quick else 512)
    total_mb = args.total_mb or (4.0 if args.quick else 250.0)
    repeats = args.repeats or (2 if args.quick else 7)
    row_bytes = int(np.prod(ROW_SHAPE))
    rng = np.random.default_rng(0)
    lengths = heavy_tailed_lengths(files, int(total_mb * 1e6 / row_bytes), rng)
    total_rows = int(lengths.sum())

    with tempfile.TemporaryDirectory(prefix="r3bench-payload-") as tmp:
        root = os.path.join(tmp, "payloads")
        writer = PayloadWriter(root)
        segments: list[PayloadSegment] = []
        floor_file = os.path.join(tmp, "floor.bin")
        with open(floor_file, "wb") as floor:
            for n in lengths:
                routes = rng.integers(0, 128, (int(n), *ROW_SHAPE), dtype=np.uint8)
                segments += writer.write(0, {"routes": routes})
                floor.write(routes.tobytes())
        unchecked = [dataclasses.replace(s, crc32c=None) for s in segments]
        reader = PayloadReader(root)

        def ours(chosen: list[PayloadSegment]) -> np.ndarray:
            out = np.empty((total_rows, *ROW_SHAPE), np.uint8)
            reader.read_into(chosen, out)
            return out

        threads = pool_workers()

        def floor_read() -> np.ndarray:
            out = np.empty((total_rows, *ROW_SHAPE), np.uint8)
            flat = memoryview(out.reshape(-1))
            step = -(-len(flat) // threads)
            fd = os.open(floor_file, os.O_RDONLY)
            try:
                fill_rows(
                    lambda i: os.preadv(fd, [flat[i * step : (i + 1) * step]], i * step),
                    threads,
                    threads,
                )
            finally:
                os.close(fd)
            return out

        np.testing.assert_array_equal(ours(segments), floor_read())
        seconds = time_interleaved(
            {
                "ours": lambda: ours(segments),
                "ours_no_checksum": lambda: ours(unchecked),
                "floor": floor_read,
            },
            repeats,
            freeze_heap=args.quick,
        )

        latency_fs = LatencyFileSystem(args.latency_ms / 1e3)
        workers = io_workers()
        latency_readers = {
            "latency_serial": PayloadReader(root, fs=latency_fs, workers=1),
            "latency_concurrent": PayloadReader(root, fs=latency_fs, workers=workers),
        }

        def latency_read(name: str) -> None:
            out = np.empty((total_rows, *ROW_SHAPE), np.uint8)
            latency_readers[name].read_into(segments, out)

        seconds.update(
            time_interleaved({name: lambda n=name: latency_read(n) for name in latency_readers}, 1)
        )

    best = {name: min(values) for name, values in seconds.items()}
    result = {
        "benchmark": "payload",
        "config": {
            "files": files,
            "rows": total_rows,
            "row_shape": list(ROW_SHAPE),
            "bytes": total_rows * row_bytes,
            "rows_min_median_max": [
                int(lengths.min()),
                int(np.median(lengths)),
                int(lengths.max()),
            ],
            "latency_ms": args.latency_ms,
            "io_workers": workers,
            "floor_threads": threads,
            "repeats": repeats,
            "quick": args.quick,
        },
        "seconds_best": best,
        "seconds_median": {name: statistics.median(v) for name, v in seconds.items()},
        "ratio_to_floor": best["ours"] / best["floor"],
        "ratio_to_floor_no_checksum": best["ours_no_checksum"] / best["floor"],
        "concurrency_speedup": best["latency_serial"] / best["latency_concurrent"],
        "targets": TARGETS,
    }
    result["met"] = {
        "ratio_to_floor": result["ratio_to_floor"] <= TARGETS["ratio_to_floor"],
        "concurrency_speedup": result["concurrency_speedup"] >= TARGETS["concurrency_speedup"],
    }

    print(
        f"{files} files, {total_rows * row_bytes / 1e6:.1f} MB of routes "
        f"(rows per file min/median/max {result['config']['rows_min_median_max']}), "
        f"best of {repeats}"
    )
    for name, value in best.items():
        print(f"  {name:<20} {value * 1e3:9.1f} ms")
    print(
        f"  read_into / floor {result['ratio_to_floor']:.2f}x (target <= 1.2; without checksums "
        f"{result['ratio_to_floor_no_checksum']:.2f}x), concurrency under {args.latency_ms:g} ms "
        f"latency {result['concurrency_speedup']:.1f}x with {workers} workers (target >= 5)"
    )
    write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
