"""pack_field against concatenation, and the buffers it allocates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.buffers import POOL_MIN_BYTES, BufferPool, empty_rows
from r3data.errors import PayloadError, SegmentError, with_context
from r3data.nodes.fill import pack_field
from r3data.payload import PayloadReader, PayloadWriter
from r3data.wire import InlineRows


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), max_size=3), max_size=5),
    st.sampled_from([np.uint8, np.uint16, np.int32]),
    st.integers(1, 3),
    st.booleans(),
)
def test_pack_field_equals_concatenation(tmp_path_factory, piece_rows, dtype, workers, handles):
    rng = np.random.default_rng(len(piece_rows))
    root = tmp_path_factory.mktemp("fill")
    writer = PayloadWriter(root)
    pieces, expected = [], []
    for sample in piece_rows:
        arrays = [rng.integers(0, 250, (n, 2, 3)).astype(np.uint8) for n in sample]
        expected.append(np.concatenate(arrays) if arrays else np.zeros((0, 2, 3), np.uint8))
        pieces.append(
            [
                writer.write(0, {"r": a})[0] if handles and i % 2 else InlineRows("r", a, 0)
                for i, a in enumerate(arrays)
            ]
        )
    packed = pack_field(
        "r",
        pieces,
        row_shape=(2, 3),
        dtype=np.dtype(dtype),
        reader=PayloadReader(root),
        workers=workers,
    )
    assert packed.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype
    assert list(packed.lengths) == [e.shape[0] for e in expected]
    for got, want in zip(packed, expected, strict=True):
        assert np.array_equal(got.numpy(), want.astype(dtype))


def test_pack_field_refuses_wrong_shapes_and_missing_reader(tmp_path):
    rows = np.zeros((2, 2, 3), np.uint8)
    with pytest.raises(SegmentError, match=r"expected rows of shape \(2, 4\), found \(2, 3\)"):
        pack_field("r", [[InlineRows("r", rows, 0)]], row_shape=(2, 4), dtype=np.uint8)
    (segment,) = PayloadWriter(tmp_path).write(0, {"r": rows})
    with pytest.raises(SegmentError, match="needs a payload reader") as info:
        pack_field("r", [[], [segment]], row_shape=(2, 3), dtype=np.uint8, workers=2)
    assert info.value.r3data_index == 1
    with pytest.raises(TypeError, match="Cannot cast"):
        pack_field(
            "r", [[InlineRows("r", rows.astype(np.int32), 0)]], row_shape=(2, 3), dtype=np.uint8
        )


@pytest.mark.parametrize("nbytes", [16, POOL_MIN_BYTES * 2])
def test_pool_buffers_are_writable_tensors_of_the_asked_shape(nbytes):
    rows = nbytes // (8 * 2)
    tensor = empty_rows((rows, 8), torch.uint16, pool=BufferPool())
    assert tensor.shape == (rows, 8)
    assert tensor.dtype == torch.uint16
    tensor.view(torch.int16).fill_(7)
    assert int(tensor.view(torch.int16).sum()) == 7 * rows * 8
    assert empty_rows((0, 3), torch.int32).shape == (0, 3)


def test_pool_recycles_a_buffer_only_once_nothing_uses_it():
    pool = BufferPool(max_free=1)
    shape = (POOL_MIN_BYTES // 64, 64)
    first = pool.empty(shape, torch.uint8)
    address = first.data_ptr()
    first.fill_(5)
    view = first[3:9].numpy()
    del first
    second = pool.empty(shape, torch.uint8)
    assert second.data_ptr() != address  # a numpy view of the first batch is still alive
    assert int(view.sum()) == 5 * view.size  # and untouched
    del view
    third = pool.empty(shape, torch.uint8)
    assert third.data_ptr() == address  # recycled: no new mapping, no page faults
    assert pool.empty((shape[0] // 4, 64), torch.uint8).data_ptr() not in (
        address,
        second.data_ptr(),
    )
    mapped = pool.nbytes
    del second, third
    pool.empty((shape[0] * 3, 64), torch.uint8)  # too big for the free ones: new, and trim
    assert pool.nbytes <= mapped + 3 * POOL_MIN_BYTES * 1.2


def test_with_context_keeps_the_class_and_chains():
    original = PayloadError("file v1/a.bin: 3 bytes short")
    wrapped = with_context(original, "sample 'x'")
    assert type(wrapped) is PayloadError
    assert str(wrapped) == "sample 'x': file v1/a.bin: 3 bytes short"
    assert wrapped.__cause__ is original
    other = KeyError("k")
    assert with_context(other, "sample 'y'") is other
    assert other.__notes__ == ["sample 'y'"]
