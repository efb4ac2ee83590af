"""Writer -> reader round trips on a real local filesystem and on memory://."""

from __future__ import annotations

import itertools
import re

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import PayloadChecksumError, SegmentError
from r3data.payload import (
    PayloadReader,
    PayloadSegment,
    PayloadWriter,
    clip,
    inspect,
)
from r3data.ragged import RaggedRows
from r3data.wire.dtypes import ALL_DTYPES


@pytest.fixture
def rng() -> np.random.Generator:
    """Each test's own generator, so that its data does not depend on the tests run before."""
    return np.random.default_rng(0)


def random_rows(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def ragged_rows(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 150_000, n, dtype=np.int32) for n in lengths]


def assert_ragged_equal(got: RaggedRows, rows: list[np.ndarray]) -> None:
    assert got.lengths.tolist() == [len(r) for r in rows]
    assert got.values.dtype == np.int32
    np.testing.assert_array_equal(got.values, np.concatenate(rows) if rows else [])


@pytest.mark.parametrize("dtype", sorted(ALL_DTYPES))
def test_every_dtype_and_row_shape_round_trips(rng, payload_root, dtype):
    fields = {
        "routes": random_rows(rng, dtype, (9, 48, 8)),
        "flat": random_rows(rng, dtype, (5,)),
        "vector": random_rows(rng, dtype, (7, 3)),
        "empty": random_rows(rng, dtype, (0, 4)),
    }
    segments = PayloadWriter(payload_root).write(3, fields, pos=11)
    assert [s.field for s in segments] == list(fields)
    assert all(re.fullmatch(r"v3/[0-9a-f]{32}\.bin", s.file) for s in segments)
    assert all(s.pos == 11 and s.crc32c is not None for s in segments)
    out = PayloadReader(payload_root).read(segments)
    for name, rows in fields.items():
        assert out[name].dtype == rows.dtype
        np.testing.assert_array_equal(out[name], rows)


@pytest.mark.parametrize("form", ["list", "tuple", "RaggedRows", "torch"])
def test_ragged_fields_round_trip_in_every_input_form(rng, payload_root, form):
    rows = ragged_rows(rng, [3, 0, 5, 1, 0, 8])
    lengths = np.array([len(r) for r in rows])
    data = {
        "list": rows,
        "tuple": (np.concatenate(rows), lengths),
        "RaggedRows": RaggedRows.from_lengths(np.concatenate(rows), lengths),
        "torch": [torch.from_numpy(r) for r in rows],
    }[form]
    routes = torch.from_numpy(random_rows(rng, "uint8", (6, 4, 2)))
    segments = PayloadWriter(payload_root).write(
        0, {"mask": data, "routes": routes}, pos={"mask": 20, "routes": 19}
    )
    mask, fixed = segments
    assert (mask.ragged, mask.pos, mask.rows, fixed.pos) == (True, 20, 6, 19)
    out = PayloadReader(payload_root).read(segments)
    assert_ragged_equal(out["mask"], rows)
    np.testing.assert_array_equal(out["routes"], routes.numpy())


def test_file_is_self_describing(rng, payload_root):
    rows = ragged_rows(rng, [2, 4])
    segments = PayloadWriter(payload_root).write(
        5, {"routes": np.ones((2, 48, 8), np.uint8), "mask": rows}, pos=7
    )
    info = inspect(f"{payload_root}/{segments[0].file}")
    assert info.header.version == 5
    assert info.header.segments() == [
        PayloadSegment(**{**s.to_dict(), "file": info.file}) for s in segments
    ]
    assert info.as_dict()["fields"][1]["nbytes"] == 6 * 4
    assert info.size >= max(e.end for e in info.header.fields)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    cuts=st.lists(st.integers(0, 30), max_size=4),
    split=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_clip_and_stitch_across_two_files_at_any_boundaries(
    tmp_path_factory, lengths, cuts, split, seed
):
    """Turn 1 wrote rows [0, split), turn 2 rows [split, n): any cut points read back exactly."""
    rng = np.random.default_rng(seed)
    root = str(tmp_path_factory.mktemp("stitch"))
    n = len(lengths)
    split = min(split, n)
    routes = random_rows(rng, "uint16", (n, 3, 2))
    rows = ragged_rows(rng, lengths)
    writer = PayloadWriter(root)
    segments = []
    for lo, hi in ((0, split), (split, n)):
        if hi > lo:
            segments += writer.write(
                1, {"routes": routes[lo:hi], "mask": rows[lo:hi]}, pos=lo + 100
            )
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    reader = PayloadReader(root)
    pieces = [clip(segments, lo + 100, hi + 100) for lo, hi in itertools.pairwise(bounds)]
    fixed = [s for piece in pieces for s in piece if s.field == "routes"]
    ragged = [s for piece in pieces for s in piece if s.field == "mask"]
    out = reader.read(fixed + ragged)
    np.testing.assert_array_equal(out["routes"], routes)
    assert_ragged_equal(out["mask"], rows)
    buffer = np.zeros_like(routes)
    reader.read_into(fixed, buffer)
    np.testing.assert_array_equal(buffer, routes)


def test_every_single_cut_of_a_file(rng, payload_root):
    routes = random_rows(rng, "uint8", (7, 48, 8))
    rows = ragged_rows(rng, [1, 0, 3, 2, 0, 4, 1])
    segments = PayloadWriter(payload_root).write(2, {"routes": routes, "mask": rows})
    reader = PayloadReader(payload_root)
    for cut in range(8):
        for lo, hi in ((0, cut), (cut, 7)):
            out = reader.read(clip(segments, lo, hi))
            if hi == lo:
                assert out == {}
                continue
            np.testing.assert_array_equal(out["routes"], routes[lo:hi])
            assert_ragged_equal(out["mask"], rows[lo:hi])


def test_read_into_fills_a_slice_of_a_batch_buffer(rng, payload_root):
    a, b = random_rows(rng, "uint8", (5, 48, 8)), random_rows(rng, "uint8", (3, 48, 8))
    writer = PayloadWriter(payload_root)
    seg_a, seg_b = writer.write(1, {"routes": a})[0], writer.write(1, {"routes": b}, pos=5)[0]
    batch = np.full((12, 48, 8), 255, np.uint8)
    PayloadReader(payload_root).read_into([seg_a, seg_b], batch[2:10])
    np.testing.assert_array_equal(batch[2:10], np.concatenate([a, b]))
    assert (batch[:2] == 255).all()
    assert (batch[10:] == 255).all()
    tensor = torch.zeros(8, 48 * 8, dtype=torch.uint8)
    PayloadReader(payload_root).read_into([seg_a, seg_b], tensor)
    np.testing.assert_array_equal(tensor.numpy().reshape(8, 48, 8), np.concatenate([a, b]))


def test_placeholder_row_repeats_the_previous_row(rng, payload_root):
    routes = random_rows(rng, "uint8", (4, 48, 8))
    (s,) = PayloadWriter(payload_root).write(1, {"routes": routes}, pos=10)
    last = PayloadSegment(s.field, s.file, s.offset + 3 * s.row_bytes, s.end, 1, s.dtype, s.shape)
    out = np.empty((5, 48, 8), np.uint8)
    PayloadReader(payload_root).read_into([s, last], out)
    np.testing.assert_array_equal(out, np.concatenate([routes, routes[3:]]))


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (np.empty((4, 48, 8), np.uint16), "out is uint16"),
        (np.empty((3, 48, 8), np.uint8), r"out is uint8 \(3, 48, 8\)"),
        (np.empty((4, 48, 16), np.uint8)[:, :, ::2], "C-contiguous"),
        (np.broadcast_to(np.empty((1, 48, 8), np.uint8), (4, 48, 8)), "writable"),
        (torch.empty(8, 4, 48).transpose(0, 1), "contiguous tensor"),
        ([0] * 4, "numpy array or CPU tensor"),
    ],
)
def test_read_into_refuses_buffers_it_cannot_fill(payload_root, out, message):
    (s,) = PayloadWriter(payload_root).write(1, {"routes": np.ones((4, 48, 8), np.uint8)})
    with pytest.raises(SegmentError, match=message):
        PayloadReader(payload_root).read_into([s], out)


def test_read_into_refuses_ragged_and_mixed_fields(rng, payload_root):
    segments = PayloadWriter(payload_root).write(
        1, {"routes": np.ones((2, 4), np.uint8), "mask": ragged_rows(rng, [1, 2])}
    )
    with pytest.raises(SegmentError, match="ragged"):
        PayloadReader(payload_root).read_into(segments[1:], np.empty(3, np.int32))
    with pytest.raises(SegmentError, match="disagree"):
        PayloadReader(payload_root).read_into(
            [segments[0], segments[1]], np.empty((3, 4), np.uint8)
        )


class CountingMemoryFS(MemoryFileSystem):
    """A private memory:// store that counts opens per path."""

    def __init__(self) -> None:
        super().__init__(global_store=False, skip_instance_cache=True)
        self.opens: dict[str, int] = {}

    def _open(self, path, mode="rb", **kwargs):
        self.opens[path] = self.opens.get(path, 0) + 1
        return super()._open(path, mode, **kwargs)


def test_read_many_opens_each_file_once(rng):
    root = "/r3test-read-many"
    fs = CountingMemoryFS()
    writer = PayloadWriter(root, fs=fs)
    arrays = [random_rows(rng, "uint8", (n, 48, 8)) for n in (3, 6, 2)]
    segments = [writer.write(1, {"routes": a})[0] for a in arrays]
    fs.opens.clear()
    outs = [np.empty((9, 48, 8), np.uint8), np.empty((4, 48, 8), np.uint8)]
    jobs = [
        ([*clip([segments[0]], 0, 3), segments[1]], outs[0]),
        ([*clip([segments[1]], 4, 6), segments[2]], outs[1]),
    ]
    PayloadReader(root, fs=fs, workers=3).read_many(jobs)
    np.testing.assert_array_equal(outs[0], np.concatenate(arrays[:2]))
    np.testing.assert_array_equal(outs[1], np.concatenate([arrays[1][4:], arrays[2]]))
    assert sorted(fs.opens.values()) == [1, 1, 1]


def test_headerless_raw_files_read_from_segments_alone(rng, payload_root):
    """prime-rl's server layout: rows back to back, no header; only the segments describe it."""
    routes = random_rows(rng, "uint8", (10, 48, 8))
    fs, path = fsspec.core.url_to_fs(payload_root)
    fs.makedirs(f"{path}/v4", exist_ok=True)
    fs.pipe_file(f"{path}/v4/raw.bin", routes.tobytes())
    row = 48 * 8
    segments = [
        PayloadSegment("routes", "v4/raw.bin", 0, 0, 4, "uint8", (48, 8)),
        PayloadSegment("routes", "./v4/raw.bin", 4 * row, 4, 6, "uint8", (48, 8)),
    ]
    reader = PayloadReader(payload_root)
    np.testing.assert_array_equal(reader.read(segments)["routes"], routes)
    assert reader.files(segments) == ["v4/raw.bin"]


def test_handles_may_name_the_root_absolutely(payload_root):
    (s,) = PayloadWriter(payload_root).write(1, {"routes": np.arange(6, dtype=np.uint8)})
    fs, path = fsspec.core.url_to_fs(payload_root)
    for name in (f"{path}/{s.file}", fs.unstrip_protocol(f"{path}/{s.file}")):
        moved = PayloadSegment(**{**s.to_dict(), "file": name})
        np.testing.assert_array_equal(
            PayloadReader(payload_root).read([moved])["routes"], np.arange(6)
        )


def test_checksum_mismatch_is_detected(rng, payload_root):
    routes = random_rows(rng, "uint8", (6, 48, 8))
    (s,) = PayloadWriter(payload_root).write(1, {"routes": routes})
    fs, path = fsspec.core.url_to_fs(payload_root)
    data = bytearray(fs.cat_file(f"{path}/{s.file}"))
    data[s.offset + 5 * s.row_bytes] ^= 0xFF
    fs.pipe_file(f"{path}/{s.file}", bytes(data))
    reader = PayloadReader(payload_root)
    with pytest.raises(PayloadChecksumError, match=rf"{s.file}.*field 'routes' rows \[0, 6\)"):
        reader.read([s])
    # a clipped segment no longer carries a checksum: the untouched rows read fine
    np.testing.assert_array_equal(reader.read(clip([s], 0, 5))["routes"], routes[:5])


def test_serial_and_concurrent_reads_agree(rng, payload_root):
    writer = PayloadWriter(payload_root)
    arrays = [random_rows(rng, "uint8", (n, 48, 8)) for n in range(1, 20)]
    segments = [writer.write(n % 3, {"routes": a})[0] for n, a in enumerate(arrays)]
    serial = PayloadReader(payload_root, workers=1).read(segments)["routes"]
    concurrent = PayloadReader(payload_root, workers=8).read(segments)["routes"]
    np.testing.assert_array_equal(serial, np.concatenate(arrays))
    np.testing.assert_array_equal(concurrent, serial)
