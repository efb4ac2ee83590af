"""Publishing on object stores: one upload streamed a block at a time, visible once complete."""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile
from store_helpers import MemoryBacked

from r3data.errors import PayloadWriteError
from r3data.payload import PayloadReader, PayloadWriter

ROOT = "/r3test-objects"
BLOCK = 64 << 10
FIELDS = {
    "routes": np.arange(2048 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(2048, 48, 8),
    "mask": [np.arange(n, dtype=np.int32) for n in (3, 0, 5000)],
}


class UploadAtClose(AbstractBufferedFile):
    """An object written the way s3fs writes one: fsspec's buffered file sends each full block
    as a part, and the object appears only when the upload completes at close."""

    def _initiate_upload(self) -> None:
        self.parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        store = self.fs
        part = self.buffer.getvalue()
        store.part_sizes.append(len(part))
        store.seen_before_close |= store.objects.exists(self.path)
        if store.fail_at_part == len(self.parts):  # once: a retried close would succeed
            store.fail_at_part = None
            raise OSError(28, "No space left on device", self.path)
        self.parts.append(part)
        if final:
            store.objects.pipe_file(self.path, b"".join(self.parts))
        return True

    def discard(self) -> None:
        """Abort the upload; like fsspec's default, a later close would still complete it."""
        self.fs.aborted.append(self.path)


class ObjectStore(MemoryBacked):
    """An object store held in memory: writes go through :class:`UploadAtClose`; reads and
    listings come from a private memory:// store."""

    protocol = "objects"

    def __init__(self, fail_at_part: int | None = None) -> None:
        super().__init__()
        self.fail_at_part = fail_at_part
        self.part_sizes: list[int] = []
        self.aborted: list[str] = []
        self.seen_before_close = False

    def makedirs(self, path, exist_ok=False):
        """Object stores have no directories."""

    def _open(self, path, mode="rb", **kwargs):
        if mode == "rb":
            return io.BytesIO(self.objects.cat_file(path))
        return UploadAtClose(self, path, mode, block_size=BLOCK)


def test_object_store_upload_streams_blocks_and_appears_only_when_complete():
    store = ObjectStore()
    segments = PayloadWriter(ROOT, fs=store).write(2, FIELDS)
    (name,) = store.objects.find(ROOT)
    size = store.objects.size(name)
    assert name == f"{ROOT}/{segments[0].file}"
    assert not store.seen_before_close
    assert sum(store.part_sizes) == size
    assert max(store.part_sizes) < 2 * BLOCK < size  # never the whole file in one buffer
    got = PayloadReader(ROOT, fs=store).read(segments)
    np.testing.assert_array_equal(got["routes"], FIELDS["routes"])
    np.testing.assert_array_equal(got["mask"].values, np.concatenate(FIELDS["mask"]))
    assert got["mask"].lengths.tolist() == [3, 0, 5000]


@pytest.mark.parametrize("fail_at_part", [0, 3])
def test_object_store_upload_failing_midway_publishes_nothing(fail_at_part):
    store = ObjectStore(fail_at_part=fail_at_part)
    with pytest.raises(PayloadWriteError, match=r"writing payload file objects://.*No space left"):
        PayloadWriter(ROOT, fs=store).write(2, FIELDS)
    gc.collect()  # collecting the abandoned file must not complete its upload either
    assert store.objects.find(ROOT) == []
    assert len(store.aborted) == 1
    assert len(store.part_sizes) == fail_at_part + 1


class WatchedMemory(MemoryFileSystem):
    """A private memory:// store that records the bytes each file holds when opened to write."""

    cachable = False

    def __init__(self) -> None:
        super().__init__(global_store=False)
        self.opened_with: list[int] = []

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self.opened_with.append(len(kwargs.get("data") or b""))
        return super()._open(path, mode, **kwargs)


def test_memory_store_gets_the_whole_file_in_one_put():
    """memory:// stores a file as soon as it is opened: it must be opened with all its bytes."""
    fs = WatchedMemory()
    segments = PayloadWriter(ROOT, fs=fs).write(1, FIELDS)
    assert fs.opened_with == [fs.size(f"{ROOT}/{segments[0].file}")]
    got = PayloadReader(ROOT, fs=fs).read(segments)
    np.testing.assert_array_equal(got["routes"], FIELDS["routes"])
