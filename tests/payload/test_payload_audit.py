"""inspect() of bare files and verify() of whole roots, including damaged headers."""

from __future__ import annotations

import re
import struct

import fsspec
import numpy as np
import pytest

from r3data.errors import PayloadFormatError, PayloadNotFoundError
from r3data.payload import MAGIC, FieldEntry, PayloadSegment, PayloadWriter, gc, inspect, verify
from r3data.payload.fileformat import MAX_TABLE_BYTES, checksum, place_fields

FIELDS = {
    "routes": np.arange(6 * 48 * 8).astype(np.uint8).reshape(6, 48, 8),
    "mask": [np.arange(n, dtype=np.int32) for n in (3, 0, 2, 5, 1, 1)],
}


def write(root: str, version: int = 1) -> str:
    return PayloadWriter(root).write(version, FIELDS, pos={"routes": 9, "mask": 10})[0].file


def damage(root: str, file: str, at: int, data: bytes | None = None, cut: int | None = None):
    fs, path = fsspec.core.url_to_fs(root)
    raw = bytearray(fs.cat_file(f"{path}/{file}"))
    if data is not None:
        raw[at : at + len(data)] = data
    fs.pipe_file(f"{path}/{file}", bytes(raw[:cut]))


def test_inspect_lists_fields_shapes_and_positions(payload_root):
    file = write(payload_root, version=4)
    info = inspect(f"{payload_root}/{file}").as_dict()
    assert (info["version"], info["format_version"]) == (4, 1)
    routes, mask = info["fields"]
    assert (routes["field"], routes["dtype"], routes["shape"], routes["pos"], routes["rows"]) == (
        "routes",
        "uint8",
        [48, 8],
        9,
        6,
    )
    assert routes["nbytes"] == 6 * 384
    assert (mask["field"], mask["dtype"], mask["rows"], mask["nbytes"]) == ("mask", "int32", 6, 48)
    assert mask["index"] % 8 == 0
    assert routes["offset"] % 64 == 0
    assert mask["offset"] % 64 == 0


def test_inspect_refuses_headerless_and_missing_files(tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(bytes(384 * 4))
    with pytest.raises(PayloadFormatError, match="headerless raw file"):
        inspect(raw)
    with pytest.raises(PayloadNotFoundError, match=r"nope\.bin"):
        inspect(tmp_path / "nope.bin")


@pytest.mark.parametrize(
    ("at", "data", "cut", "message"),
    [
        (8, struct.pack("<I", 9), None, "format version 1, found 9"),
        (12, b"\x00\x00\x00\x00", None, "table checksum mismatch"),
        (16, struct.pack("<Q", MAX_TABLE_BYTES + 1), None, "table claims"),
        (30, b"#", None, "table checksum mismatch"),
        (0, b"", 40, "table claims"),
        (0, b"", 12, r"header of at least 24 bytes after its magic .*12-byte file \(cut short\)"),
        (0, b"", 600, r"field 'routes' claims bytes"),
    ],
)
def test_damaged_headers_are_reported(payload_root, at, data, cut, message):
    file = write(payload_root)
    damage(payload_root, file, at, data, cut)
    with pytest.raises(PayloadFormatError, match=message):
        inspect(f"{payload_root}/{file}")
    report = verify(payload_root)
    assert not report.ok
    assert list(report.corrupt) == [file]
    assert re.search(message, report.corrupt[file])


def test_verify_walks_a_root(payload_root):
    good = [write(payload_root, v) for v in (1, 2, 5)]
    bad = write(payload_root, 2)
    info = inspect(f"{payload_root}/{bad}")
    mask = info.header.fields[1]
    damage(payload_root, bad, mask.segment.offset + 4, b"\xff")
    fs, path = fsspec.core.url_to_fs(payload_root)
    fs.pipe_file(f"{path}/v5/raw.bin", bytes(384 * 3))
    fs.pipe_file(f"{path}/v5/.dead.bin.tmp", b"half")
    fs.pipe_file(f"{path}/stray.bin", MAGIC)
    report = verify(payload_root, step=4, max_off_policy_steps=2)
    assert not report.ok
    assert report.corrupt.keys() == {bad}
    assert "field 'mask'" in report.corrupt[bad]
    assert "expected crc32c" in report.corrupt[bad]
    assert report.files_checked == len(good) + 1  # the corrupt one was checked too
    assert report.bytes_checked == sum(fs.size(f"{path}/{f}") for f in [*good, bad])
    assert report.headerless == ["v5/raw.bin"]
    assert report.temporary == ["v5/.dead.bin.tmp"]
    assert report.orphans == ["stray.bin"]
    assert report.versions == [1, 2, 5]
    assert report.stale_versions == [1, 2]
    assert report.as_dict()["ok"] is False


def test_verify_of_a_clean_root(payload_root):
    write(payload_root)
    report = verify(payload_root, workers=1)
    assert report.ok
    assert (report.files_checked, report.corrupt, report.stale_versions) == (1, {}, [])


def test_verify_checks_ragged_index_tables(tmp_path):
    """A file whose checksums are right but whose index table runs backwards."""
    values = np.arange(6, dtype=np.int32)
    index = np.array([0, 4, 2, 6], "<i8")
    draft = FieldEntry(
        PayloadSegment(
            "mask", "v1/x.bin", 0, 0, 3, "int32", index=0, crc32c=checksum(values, index)
        ),
        values.nbytes,
    )
    header, (entry,) = place_fields(1, [draft])
    data = bytearray(entry.end)
    data[: len(header)] = header
    data[entry.segment.offset : entry.segment.offset + values.nbytes] = values.tobytes()
    data[entry.segment.index : entry.end] = index.tobytes()
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "x.bin").write_bytes(bytes(data))
    report = verify(tmp_path)
    assert report.corrupt == {  # named once: by the key
        "v1/x.bin": "ragged index of field 'mask' must rise from 0 to 6, found [0, 4, 2, 6]..."
    }


def test_verify_and_gc_of_a_missing_root(tmp_path):
    with pytest.raises(PayloadNotFoundError, match=r"payload root .*typo does not exist"):
        verify(tmp_path / "typo")
    with pytest.raises(PayloadNotFoundError, match="typo"):
        gc(str(tmp_path / "typo"), step=3, max_off_policy_steps=1)
