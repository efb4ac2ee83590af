"""Review of the payload root's names and of segments built by hand: a root-relative name is
never normalised a second time (on a bucket root that names another file), and segments
clipped at numpy bounds, copied, replaced or pickled keep their derived sizes and stay JSON."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import replace
from typing import ClassVar

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from r3data.errors import PayloadHandleError
from r3data.payload import PayloadRoot, PayloadSegment, clip


class _BucketFileSystem(MemoryFileSystem):
    """Paths named as an object store names them: no root marker, ``bucket/key`` is whole."""

    root_marker = ""
    protocol = ("reviewmem",)
    store: ClassVar[dict] = {}  # its own files, not memory://'s
    pseudo_dirs: ClassVar[list] = [""]


def test_removing_a_listed_name_on_a_bucket_root_removes_that_file_only():
    """The file ``b/run/b/run/x.bin`` is listed under the root ``b/run`` as ``b/run/x.bin``;
    normalising that name again would delete the root's own ``x.bin``, a file still needed."""
    fs = _BucketFileSystem()
    fs.store.clear()
    fs.pipe("/b/run/b/run/x.bin", b"inner")
    fs.pipe("/b/run/x.bin", b"outer")
    root = PayloadRoot("b/run", fs=fs)
    listed = dict(root.files(fs.find("/b/run", detail=True).values()))
    assert set(listed) == {"b/run/x.bin", "x.bin"}
    root.remove("b/run/x.bin")
    assert sorted(fs.store) == ["/b/run/x.bin"]
    assert fs.cat("/b/run/x.bin") == b"outer"
    root.remove("x.bin")
    assert sorted(fs.store) == []


@pytest.mark.parametrize("name", ["../x.bin", "/b/run/x.bin", "v1/../../x.bin", "v1//x.bin", ""])
def test_remove_refuses_what_is_not_a_root_relative_name(tmp_path, name):
    (tmp_path / "v1").mkdir()
    (tmp_path / "x.bin").write_bytes(b"x")
    with pytest.raises(PayloadHandleError, match="expected a normalised name inside the root"):
        PayloadRoot(tmp_path / "v1").remove(name)
    assert (tmp_path / "x.bin").exists()


def test_segments_clipped_at_numpy_bounds_are_plain_ints_and_json():
    s = PayloadSegment("r", "v1/a.bin", 0, 0, 10, "uint8", (2,))
    (part,) = clip([s], np.int64(2), np.int64(5))
    assert [type(getattr(part, k)) for k in ("offset", "pos", "rows", "end", "nbytes")] == [int] * 5
    assert json.loads(json.dumps(part.to_dict())) == {
        "field": "r",
        "file": "v1/a.bin",
        "offset": 4,
        "pos": 2,
        "rows": 3,
        "dtype": "uint8",
        "shape": [2],
    }


def test_copied_replaced_and_pickled_segments_keep_their_derived_fields_in_step():
    s = PayloadSegment("r", "v1/a.bin", 8, 3, 10, "<u2", [4], crc32c=7)
    part = s.clipped(5, 9)
    derived = ("ragged", "end", "row_shape", "itemsize", "row_bytes", "nbytes")
    for made, pos, rows in (
        (copy.copy(part), 5, 4),
        (copy.deepcopy(part), 5, 4),
        (pickle.loads(pickle.dumps(part)), 5, 4),
        (replace(part, rows=2), 5, 2),
        (replace(s, pos=0), 0, 10),
    ):
        fresh = PayloadSegment("r", "v1/a.bin", made.offset, pos, rows, "uint16", (4,))
        assert made == fresh
        assert hash(made) == hash(fresh)
        assert {k: getattr(made, k) for k in derived} == {k: getattr(fresh, k) for k in derived}
    with pytest.raises(ValueError, match="init=False"):
        replace(s, nbytes=1)
    ragged = PayloadSegment("m", "v1/a.bin", 0, 0, 3, "int32", index=64)
    assert replace(ragged, rows=5).nbytes == 6 * 8
    assert pickle.loads(pickle.dumps(ragged.clipped(1, 3))).nbytes == 3 * 8
