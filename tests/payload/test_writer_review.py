"""Review of PayloadWriter: what it refuses (typed, before writing), where it writes, and what a
failing store leaves."""

from __future__ import annotations

import os
import threading

import fsspec
import numpy as np
import pytest
from fsspec.spec import AbstractBufferedFile
from store_helpers import MemoryBacked

from r3data.errors import PayloadWriteError, SegmentError
from r3data.payload import PayloadReader, PayloadWriter, verify

ROUTES = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)
INT64_MAX = 2**63 - 1


def nothing_written(root: str) -> bool:
    fs, path = fsspec.core.url_to_fs(root)
    return not fs.exists(path) or fs.find(path) == []


@pytest.mark.parametrize(
    ("version", "fields", "pos", "message"),
    [
        (1, {"\ud800": ROUTES}, 0, r"field name: expected UTF-8 text, found '\\ud800'"),
        (2**63, {"routes": ROUTES}, 0, rf"version: expected an int in \[0, {INT64_MAX}\]"),
        (10**30, {"routes": ROUTES}, 0, r"version: expected an int in \[0, "),
        (1, {"routes": ROUTES}, 2**63, rf"'routes' pos: expected an int in \[0, {INT64_MAX}\]"),
        (1, {"routes": ROUTES}, {"routes": 10**30}, r"'routes' pos: expected an int in"),
        (1, {"routes": ROUTES}, -1, r"'routes' pos: expected an int in"),
        (1, {"routes": ROUTES}, 1.5, r"'routes' pos: expected an int in"),
        (
            1,
            {"mask": (np.zeros(0, np.int32), np.full(4, 2**62, np.int64))},  # sum wraps to 0
            0,
            r"row_lengths: expected each <= the 0 values, found 4611686018427387904",
        ),
        (
            1,
            {"mask": (np.arange(2, dtype=np.int32), np.array([2**63 - 1, 2**63 - 1, 4]))},
            0,
            r"row_lengths: expected each <= the 2 values",
        ),
    ],
)
def test_fields_no_header_can_hold_are_refused_before_writing(
    payload_root, version, fields, pos, message
):
    """Names that are not UTF-8, integers past int64 and row lengths whose sum wraps around
    int64: a typed error naming the value, and nothing written."""
    with pytest.raises(SegmentError, match=message):
        PayloadWriter(payload_root).write(version, fields, pos=pos)
    assert nothing_written(payload_root)


def test_the_largest_version_and_position_round_trip(payload_root):
    (segment,) = PayloadWriter(payload_root).write(INT64_MAX, {"routes": ROUTES}, pos=INT64_MAX)
    assert segment.file.startswith(f"v{INT64_MAX}/")
    assert segment.pos == INT64_MAX
    np.testing.assert_array_equal(PayloadReader(payload_root).read([segment])["routes"], ROUTES)


class UnreachableStore(MemoryBacked):
    """An object store whose connection drops during an upload: the client library raises its
    own exception, not an OSError (s3fs passes botocore's connection errors through as they
    are)."""

    protocol = "unreachable"

    def makedirs(self, path, exist_ok=False):
        """Object stores have no directories."""

    def _open(self, path, mode="rb", **kwargs):
        return DroppedUpload(self, path, mode, block_size=1 << 10)


class EndpointConnectionError(Exception):
    """What botocore raises when an endpoint stops answering (not an OSError)."""


class DroppedUpload(AbstractBufferedFile):
    def _initiate_upload(self) -> None:
        pass

    def _upload_chunk(self, final: bool = False) -> bool:
        raise EndpointConnectionError('Could not connect to the endpoint URL: "http://s3:8333"')

    def discard(self) -> None:
        self.fs.discarded = True


def test_a_client_library_error_during_an_upload_is_a_write_error():
    store = UnreachableStore()
    with pytest.raises(PayloadWriteError, match=r"unreachable://run/v1/.*Could not connect"):
        PayloadWriter("run", fs=store).write(1, {"routes": np.zeros((4096, 3, 2), np.uint8)})
    assert store.objects.find("run") == []
    assert store.discarded


def test_a_root_that_is_a_symlink_is_written_through(tmp_path):
    target = tmp_path / "volume"
    target.mkdir()
    (tmp_path / "root").symlink_to(target)
    (segment,) = PayloadWriter(tmp_path / "root").write(3, {"routes": ROUTES})
    assert (target / segment.file).is_file()
    assert verify(tmp_path / "root").ok
    np.testing.assert_array_equal(
        PayloadReader(tmp_path / "root").read([segment])["routes"], ROUTES
    )


def test_a_version_folder_that_is_a_file_is_a_write_error(tmp_path):
    (tmp_path / "v1").write_bytes(b"not a folder")
    with pytest.raises(PayloadWriteError, match=r"writing payload file .*/v1/.*\.bin"):
        PayloadWriter(tmp_path).write(1, {"routes": ROUTES})
    assert (tmp_path / "v1").read_bytes() == b"not a folder"


def test_concurrent_writers_of_one_version_never_share_a_file(payload_root):
    """Threads writing the same version at once (one folder created by whichever comes first):
    every file is its own, complete and named once."""
    writer = PayloadWriter(payload_root)
    written: dict[int, list] = {}
    start = threading.Barrier(6)

    def write(i: int) -> None:
        start.wait()
        written[i] = [writer.write(5, {"routes": ROUTES + i}) for _ in range(4)]

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    files = [s[0].file for runs in written.values() for s in runs]
    assert len(set(files)) == 24
    report = verify(payload_root)
    assert (report.ok, report.files_checked, report.temporary) == (True, 24, [])
    reader = PayloadReader(payload_root)
    for i, runs in written.items():
        for segments in runs:
            np.testing.assert_array_equal(reader.read(segments)["routes"], ROUTES + i)


def test_a_local_write_leaves_only_the_final_name(tmp_path):
    PayloadWriter(tmp_path).write(1, {"routes": ROUTES})
    (name,) = os.listdir(tmp_path / "v1")
    assert not name.startswith(".")
    assert name.endswith(".bin")
