"""Rank-local reads: each (CP, TP) rank reads only its rows, and expanding them equals
expanding the full batch on that rank."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from r3data import loader
from r3data.layout import TokenLayout, expand
from r3data.payload import PayloadRoot, PayloadWriter

LAYERS, TOPK, EXPERTS = 4, 2, 16


class CountingReads(io.RawIOBase):
    def __init__(self, f, counter) -> None:
        self.f, self.counter = f, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def readinto(self, buffer) -> int:
        n = self.f.readinto(buffer)
        self.counter(n)
        return n


class CountingFS(MemoryFileSystem):
    """memory:// that counts the bytes read through it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(skip_instance_cache=True, **kwargs)
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        return CountingReads(f, self._count) if "r" in mode else f


def by_handle_samples(fs, root, lengths, rng):
    writer = PayloadWriter(root, fs=fs)
    samples = []
    for i, n in enumerate(lengths):
        rows = rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
        (segment,) = writer.write(0, {"routed_experts": rows})
        request = {"prompt_len": n // 2, "completion_len": n - n // 2, "sources": [segment]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    return samples


@pytest.mark.parametrize("packed", [True, False])
def test_each_rank_reads_its_share_and_expands_like_the_full_batch(packed):
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(200, 400, 6)]
    fs = CountingFS()
    root = f"/local-reads-{packed}"
    samples = by_handle_samples(fs, root, lengths, rng)
    options = {"batch_size": 6, "payload_root": PayloadRoot(root, fs), "collate": {"workers": 2}}
    fs.bytes_read = 0
    (full,) = loader(samples, **options)
    full_bytes = fs.bytes_read
    assert full_bytes >= sum(n - 1 for n in lengths) * LAYERS * TOPK
    seen = np.zeros(sum(lengths), dtype=int)
    boundary = 8 * len(lengths) * LAYERS * TOPK  # a placeholder row or two per sample and range
    per_rank = []
    for cp_rank in range(2):
        for tp_rank in range(2):
            layout = TokenLayout(
                tp_size=2,
                tp_rank=tp_rank,
                sequence_parallel=True,
                cp_size=2,
                cp_rank=cp_rank,
                packed=packed,
            )
            fs.bytes_read = 0
            (local,) = loader(samples, layout=layout, **options)
            per_rank.append(fs.bytes_read)
            if packed:  # THD pads each sample to 2*CP*TP: every rank gets a quarter of each
                assert fs.bytes_read <= full_bytes / 4 + boundary
            assert local.metadata["layout"] is layout
            lengths_full = local["token_ids"].lengths
            want = expand(full["routed_experts"], layout)
            got = expand(local["routed_experts"])  # the rows carry their layout and lengths
            assert len(got) == LAYERS
            again = expand(local["routed_experts"], layout, local=True, lengths=lengths_full)
            assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
            ranges = layout.local_ranges(lengths_full)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            for b, sample_ranges in enumerate(ranges):
                for lo, hi in sample_ranges:
                    seen[offsets[b] + lo : offsets[b] + hi] += 1
            assert local["routed_experts_valid"].total_rows == local["routed_experts"].total_rows
    assert (seen == 1).all()  # every real token is on exactly one (cp, tp) rank
    assert full_bytes <= sum(per_rank) <= full_bytes + boundary  # no byte is read twice


def test_ragged_masks_are_cut_to_the_rank_like_the_routes(tmp_path):
    rng = np.random.default_rng(1)
    writer = PayloadWriter(tmp_path)
    samples = []
    for i, n in enumerate([37, 52, 21]):
        prompt = n // 3
        routes = rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
        masks = [rng.choice(99, int(rng.integers(1, 6)), replace=False) for _ in range(n - prompt)]
        segments = writer.write(
            0,
            {"routed_experts": routes, "sampling_mask": [m.astype(np.int32) for m in masks]},
            pos={"routed_experts": 0, "sampling_mask": prompt},
        )
        request = {"prompt_len": prompt, "completion_len": n - prompt, "sources": segments}
        samples.append({"id": f"m{i}", "token_ids": np.arange(n), "requests": [request]})
    options = {
        "batch_size": 3,
        "payload_root": tmp_path,
        "collate": {"fields": ("routed_experts", "sampling_mask"), "workers": 2},
    }
    (full,) = loader(samples, **options)
    layout = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=0)
    (local,) = loader(samples, layout=layout, **options)
    ranges = layout.local_ranges(full["token_ids"].lengths)
    for b, sample_ranges in enumerate(ranges):
        positions = np.concatenate([np.arange(lo, hi) for lo, hi in sample_ranges] or [[]])
        positions = positions.astype(np.int64)
        for name in ("routed_experts", "sampling_mask_valid"):
            got, want = local[name][b].numpy(), full[name][b].numpy()[positions]
            assert np.array_equal(got, want), (name, b)
        got, want = local["sampling_mask"][b], full["sampling_mask"][b]  # ragged, CSR
        assert got.lengths.tolist() == want.lengths[positions].tolist()
        for row, position in enumerate(positions):
            assert np.array_equal(
                got[row : row + 1].compact()[0], want[position : position + 1].compact()[0]
            )
