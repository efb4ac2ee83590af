"""Review of the payload file format: round trips of random fields, and hostile bytes.

A hostile producer can compute a table's CRC as well as the writer can, so every check of the
table must hold on its own: the tables here carry valid checksums unless the case is the
checksum itself.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import tempfile
from pathlib import Path

import fsspec
import numpy as np
import orjson
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_payload_roundtrip import random_rows

from r3data.errors import PackedError, PayloadFormatError
from r3data.payload import (
    MAGIC,
    FieldEntry,
    PayloadReader,
    PayloadSegment,
    PayloadWriter,
    inspect,
    read_header,
    verify,
)
from r3data.payload.fileformat import FORMAT_VERSION, PREFIX, checksum, place_fields
from r3data.ragged import RaggedRows
from r3data.wire.dtypes import ALL_DTYPES

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

FIELDS = {
    "routes": np.arange(5 * 4 * 2, dtype=np.uint16).reshape(5, 4, 2),
    "mask": [np.arange(n, dtype=np.int32) for n in (3, 0, 2)],
    "empty": np.zeros((0, 3), np.float32),
}


def rows_of(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return random_rows(np.random.default_rng(seed), dtype, shape)


@st.composite
def field_sets(draw):
    """1 to 3 fields: fixed of any dtype and row shape (zero rows too), or ragged (empty rows)."""
    names = draw(
        st.lists(
            st.sampled_from(["routes", "mask", "logprobs", "é"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    fields, pos = {}, {}
    for i, name in enumerate(names):
        dtype = draw(st.sampled_from(sorted(ALL_DTYPES)))
        rows = draw(st.integers(0, 6))
        if draw(st.booleans()):
            lengths = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
            fields[name] = [rows_of(dtype, (n,), i * 100 + j) for j, n in enumerate(lengths)]
            if not lengths:
                fields[name] = (np.zeros(0, dtype), np.zeros(0, np.int64))
        else:
            row_shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            fields[name] = rows_of(dtype, (rows, *row_shape), i)
        pos[name] = draw(st.integers(0, 2**40))
    return fields, pos


def assert_read_back(got, data) -> None:
    if isinstance(got, RaggedRows):
        if isinstance(data, tuple):
            values, lengths = data
        else:
            values = np.concatenate(data) if data else np.zeros(0, got.values.dtype)
            lengths = [len(row) for row in data]
        assert got.lengths.tolist() == list(lengths)
        assert got.values.dtype == values.dtype
        np.testing.assert_array_equal(got.values, values)
    else:
        assert got.dtype == data.dtype
        assert got.shape == data.shape
        np.testing.assert_array_equal(got, data)


@SETTINGS
@given(case=field_sets())
def test_random_fields_round_trip_on_local_and_memory_roots(case):
    """Every dtype, row shape, zero rows and empty ragged rows: what is written is read back,
    the header describes exactly the segments returned, and both filesystems hold the same
    bytes (the header never holds the file's own name)."""
    fields, pos = case
    memory = MemoryFileSystem(skip_instance_cache=True, global_store=False)
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for root, fs in ((tmp, None), ("/r3-review", memory)):
            segments = PayloadWriter(root, fs=fs).write(7, fields, pos=pos)
            assert [s.field for s in segments] == list(fields)
            assert [s.pos for s in segments] == [pos[name] for name in fields]
            got = PayloadReader(root, fs=fs).read(segments)
            for name, data in fields.items():
                assert_read_back(got[name], data)
            info = inspect(f"{root}/{segments[0].file}", fs=fs)
            assert info.header.version == 7
            assert [dataclasses.replace(s, file=s.file) for s in segments] == [
                dataclasses.replace(s, file=segments[0].file) for s in info.header.segments()
            ]
            assert info.size == max(entry.end for entry in info.header.fields)
            files.append((fs or fsspec.filesystem("file")).cat_file(f"{root}/{segments[0].file}"))
            assert verify(root, fs=fs).ok
        assert files[0] == files[1]


def written(root: Path) -> tuple[str, bytes]:
    """A real payload file under ``root``: its root-relative name and its bytes."""
    segments = PayloadWriter(root).write(3, FIELDS, pos={"routes": 1, "mask": 2, "empty": 0})
    return segments[0].file, (root / segments[0].file).read_bytes()


def test_every_truncation_is_refused_and_verify_names_the_file(tmp_path):
    name, raw = written(tmp_path)
    for cut in range(len(raw)):
        with pytest.raises(PayloadFormatError, match=r"expected|claims|checksum"):
            read_header(io.BytesIO(raw[:cut]), name)
    for cut in (*range(1, len(MAGIC) + 1), PREFIX.size, PREFIX.size + 10, len(raw) - 1):
        (tmp_path / name).write_bytes(raw[:cut])
        report = verify(tmp_path, workers=1)
        assert list(report.corrupt) == [name], (cut, report)
        assert report.headerless == []


@SETTINGS
@given(
    flips=st.lists(st.tuples(st.integers(0, 2**16), st.integers(1, 255)), min_size=1, max_size=3)
)
def test_a_damaged_byte_is_caught_or_changes_nothing_read(tmp_path_factory, flips):
    """After any damage past the magic, verify reports the file corrupt, or every field of its
    header still reads back exactly what was written (the damage hit padding)."""
    root = tmp_path_factory.mktemp("flips")
    name, raw = written(root)
    damaged = bytearray(raw)
    for at, xor in flips:
        damaged[len(MAGIC) + at % (len(raw) - len(MAGIC))] ^= xor
    (root / name).write_bytes(bytes(damaged))
    report = verify(root, workers=1)
    assert report.headerless == []
    if report.corrupt:
        assert list(report.corrupt) == [name]
        return
    assert report.ok
    header = read_header(io.BytesIO(bytes(damaged)), name)
    got = PayloadReader(root).read(header.segments())
    for field, data in FIELDS.items():
        assert_read_back(got[field], data)


# --- hostile tables ---------------------------------------------------------------------------


def craft(table: bytes | dict, size: int = 2048, crc: int | None = None, length=None) -> bytes:
    """A payload file of ``size`` bytes whose table is ``table`` (a valid checksum unless
    ``crc`` is given); data bytes are zero."""
    if isinstance(table, dict):
        table = orjson.dumps(table)
    crc = checksum(table) if crc is None else crc
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, crc, len(table) if length is None else length)
    head = prefix + table
    return head + bytes(max(0, size - len(head)))


def entry(**changes) -> dict:
    base = {"field": "routes", "offset": 512, "pos": 0, "rows": 4, "dtype": "uint8"}
    return {**base, "shape": [2], "crc32c": 0, "nbytes": 8, **changes}


def table(*entries, version=1) -> dict:
    return {"version": version, "fields": list(entries)}


HOSTILE = {
    "two fields on the same bytes": (
        table(entry(), entry(field="mask")),
        r"field 'mask' at \[512, 520\) and field 'routes' at \[512, 520\), which overlap",
    ),
    "a field starting inside another": (
        table(entry(nbytes=16, rows=8), entry(field="mask", offset=520)),
        r"field 'routes' at \[512, 528\) and field 'mask' at \[520, 528\), which overlap",
    ),
    "a ragged index on its own values": (
        table(entry(shape=[], rows=1, nbytes=16, dtype="int32", index=520)),
        r"field 'routes' at \[512, 528\) and field 'routes' at \[520, 536\)",
    ),
    "a field inside the header": (table(entry(offset=0)), r"claims bytes \[0, 8\)"),
    "a field past the end": (table(entry(offset=2044)), r"claims bytes \[2044, 2052\)"),
    "an index past the end": (
        table(entry(shape=[], rows=2, nbytes=4, dtype="int32", index=2040)),
        r"claims bytes \[2040, 2064\)",
    ),
    "2**60 rows (no allocation)": (
        table(entry(rows=2**60, nbytes=2**61)),
        r"claims bytes \[512, 2305843009213694464\)",
    ),
    "rows that do not fill nbytes": (table(entry(rows=3)), "need 6 bytes, entry says 8"),
    "ragged values not whole items": (
        table(entry(shape=[], rows=0, nbytes=3, dtype="int32", index=520)),
        "need 3 bytes",
    ),
    "a field named twice": (
        table(entry(), entry(offset=576)),
        "lists a field twice",
    ),
    "a negative offset": (
        table(entry(offset=-64)),
        "offset: expected an int in \\[0, 9223372036854775807\\], found -64",
    ),
    "a float offset": (
        table(entry(offset=512.0)),
        "offset: expected an int in \\[0, 9223372036854775807\\], found 512.0",
    ),
    "a bool row count": (table(entry(rows=True)), "rows: expected an int >= 0"),
    "an integer beyond 64 bits (JSON float)": (
        orjson.dumps(table(entry())).replace(b'"rows":4', b'"rows":18446744073709551616'),
        "rows: expected an int >= 0, found 1.8",
    ),
    "a string version": (table(entry(), version="1"), "version: expected an int >= 0"),
    "no crc32c": (table({k: v for k, v in entry().items() if k != "crc32c"}), "has no crc32c"),
    "a crc32c beyond 32 bits": (table(entry(crc32c=2**32)), "crc32c: expected an int in"),
    "an unknown dtype": (table(entry(dtype="complex64")), "dtype: expected one of"),
    "a big-endian dtype": (table(entry(dtype=">u2", nbytes=16)), "dtype: expected one of"),
    "a field that is not an object": (table(["routes"]), "must be an object"),
    "fields that are not a list": ({"version": 1, "fields": {"routes": {}}}, "'fields' list"),
    "a table that is a list": (b"[1, 2]", "'fields' list"),
    "NaN in the table": (b'{"version": NaN, "fields": []}', "not JSON"),
    "a lone surrogate escape": (b'{"version": 1, "fields": [{"field": "\\ud800"}]}', "not JSON"),
    "bytes that are not UTF-8": (b'{"version": 1, "fields": [{"field": "\xff"}]}', "not JSON"),
    "a bad checksum": (table(entry()), "checksum mismatch"),
    "a table past the end": (table(entry()), "table claims 5000 bytes"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_tables_are_refused_before_any_data_is_read(tmp_path, case):
    body, message = HOSTILE[case]
    crc = 0x12345678 if case == "a bad checksum" else None
    raw = craft(body, crc=crc, length=5000 if case == "a table past the end" else None)
    with pytest.raises(PayloadFormatError, match=message):
        read_header(io.BytesIO(raw), "x.bin")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "x.bin").write_bytes(raw)
    report = verify(tmp_path)
    assert list(report.corrupt) == ["v1/x.bin"]


def test_a_field_claiming_bytes_past_the_end_allocates_nothing(tmp_path):
    """A huge row count is compared with the file's size, never allocated."""
    raw = craft(table(entry(rows=2**40, shape=[48, 8], nbytes=2**40 * 384)), size=4096)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "x.bin").write_bytes(raw)
    with pytest.raises(PayloadFormatError, match="claims bytes"):
        inspect(tmp_path / "v1" / "x.bin")


def wrapped_index_file(root: Path) -> PayloadSegment:
    """A file whose ragged index has a valid checksum but wraps around int64: every step is
    2**62 modulo 2**64, the offsets themselves go negative."""
    values = np.zeros(0, np.int32)
    index = np.array([0, 2**62, -(2**63), -(2**62), 0], "<i8")
    draft = FieldEntry(
        PayloadSegment(
            "mask", "v1/x.bin", 0, 0, 4, "int32", index=0, crc32c=checksum(values, index)
        ),
        values.nbytes,
    )
    header, (placed,) = place_fields(1, [draft])
    data = bytearray(placed.end)
    data[: len(header)] = header
    data[placed.segment.index : placed.end] = index.tobytes()
    (root / "v1").mkdir()
    (root / "v1" / "x.bin").write_bytes(bytes(data))
    return placed.segment


def test_a_ragged_index_that_wraps_around_int64_is_refused(tmp_path):
    segment = wrapped_index_file(tmp_path)
    report = verify(tmp_path)
    assert list(report.corrupt) == ["v1/x.bin"]
    assert "ragged index of field 'mask' must rise from 0 to 0" in report.corrupt["v1/x.bin"]
    with pytest.raises(PayloadFormatError, match="must be non-decreasing"):
        PayloadReader(tmp_path).read([segment])
    offsets = np.array([0, 2**62, -(2**63), -(2**62), 0], np.int64)
    with pytest.raises(PackedError, match="non-decreasing offsets"):
        RaggedRows(np.zeros(0, np.int32), offsets)


def test_a_file_that_only_starts_like_the_magic_is_corrupt_not_headerless(tmp_path):
    """A payload file cut inside its magic is a damaged payload file; any other file without
    the magic stays headerless (prime-rl's raw layout)."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "cut.bin").write_bytes(MAGIC[:5])
    (tmp_path / "v1" / "raw.bin").write_bytes(bytes(7))
    (tmp_path / "v1" / "empty.bin").write_bytes(b"")
    report = verify(tmp_path)
    assert list(report.corrupt) == ["v1/cut.bin"]
    assert "expected an r3data payload header" in report.corrupt["v1/cut.bin"]
    assert report.headerless == ["v1/empty.bin", "v1/raw.bin"]


def test_prefix_layout_is_the_documented_one(tmp_path):
    """Magic, format version, table CRC-32C, table length, JSON table, data 64-aligned."""
    _, raw = written(tmp_path)
    magic, version, crc, length = struct.unpack_from("<8sIIQ", raw)
    body = raw[PREFIX.size : PREFIX.size + length]
    assert (magic, version, crc) == (MAGIC, 1, checksum(body))
    parsed = orjson.loads(body)
    assert parsed["version"] == 3
    assert all(e["offset"] % 64 == 0 for e in parsed["fields"])
    assert all(e["index"] % 8 == 0 for e in parsed["fields"] if "index" in e)
