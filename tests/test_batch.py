"""TensorBatch against a naive model: one dict per sample."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.batch import PerSample, TensorBatch, merge_metadata
from r3data.errors import PackedError
from r3data.packed import PackedTensor
from r3data.trace import StitchStats


@st.composite
def batches(draw, max_batch: int = 6):
    """Samples as dicts (the model) and the TensorBatch holding them."""
    size = draw(st.integers(0, max_batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    samples = [
        {
            "routes": torch.from_numpy(rng.integers(0, 255, (int(rng.integers(0, 5)), 2, 2))).to(
                torch.uint16
            ),
            "reward": torch.tensor(float(rng.normal())),
            "id": f"s{i}",
        }
        for i in range(size)
    ]
    batch = TensorBatch(
        {
            "routes": PackedTensor.from_segments(
                [s["routes"] for s in samples], row_shape=(2, 2), dtype=torch.uint16
            ),
            "reward": torch.stack([s["reward"] for s in samples]) if samples else torch.zeros(0),
            "id": [s["id"] for s in samples],
        },
        metadata={"step": 3},
    )
    return samples, batch


def assert_matches(batch: TensorBatch, samples: list[dict]) -> None:
    assert batch.batch_size == len(samples)
    assert list(batch) == ["routes", "reward", "id"]
    for i, sample in enumerate(samples):
        assert torch.equal(batch["routes"][i], sample["routes"])
        assert torch.equal(batch["reward"][i], sample["reward"])
        assert batch["id"][i] == sample["id"]
    assert batch.metadata == {"step": 3}


@settings(max_examples=40, deadline=None)
@given(batches(), st.data())
def test_selection_matches_model(case, data):
    samples, batch = case
    size = len(samples)
    assert_matches(batch, samples)
    start, stop = data.draw(st.integers(-7, 7)), data.draw(st.integers(-7, 7))
    step = data.draw(st.sampled_from([None, 1, 2, -1]))
    assert_matches(batch[start:stop:step], samples[start:stop:step])
    picks = data.draw(st.lists(st.integers(0, size - 1), max_size=7)) if size else []
    assert_matches(batch[picks], [samples[i] for i in picks])
    mask = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    kept = [s for s, keep in zip(samples, mask, strict=True) if keep]
    assert_matches(batch[np.array(mask, dtype=bool)], kept)


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(1, 4), st.integers(0, 3))
def test_chunk_cat_repeat(case, parts, n):
    samples, batch = case
    chunks = batch.chunk(parts)
    assert len(chunks) <= parts
    assert sum(c.batch_size for c in chunks) == len(samples)
    assert_matches(TensorBatch.cat(chunks), samples)
    for chunk in chunks:  # views: the same storage as the batch
        if chunk["routes"].total_rows:
            storage = chunk["routes"].values.untyped_storage().data_ptr()
            assert storage == batch["routes"].values.untyped_storage().data_ptr()
    assert_matches(batch.repeat(n), samples * n)
    assert_matches(batch.repeat_interleave(n), [s for s in samples for _ in range(n)])


@settings(max_examples=25, deadline=None)
@given(batches())
def test_pickle_round_trip_out_of_band(case):
    samples, batch = case
    buffers: list[pickle.PickleBuffer] = []
    restored = pickle.loads(
        pickle.dumps(batch, protocol=5, buffer_callback=buffers.append), buffers=buffers
    )
    assert restored == batch
    assert len(buffers) == 2  # the packed values and the reward tensor travel out of band
    assert_matches(pickle.loads(pickle.dumps(batch)), samples)


def test_select_to_and_repr():
    batch = TensorBatch({"a": torch.arange(3), "b": ["x", "y", "z"]}, metadata={"k": 1})
    only_a = batch.select(["a"])
    assert list(only_a) == ["a"]
    assert only_a["a"] is batch["a"]
    moved = batch.to("cpu")
    assert moved == batch
    assert moved["b"] is batch["b"]
    assert repr(batch) == (
        "TensorBatch(B=3\n  a: tensor shape=(3,) dtype=torch.int64\n  b: list[3]\n"
        "  metadata: ['k'])"
    )
    assert batch != batch.select(["a"])
    assert batch.__eq__(3) is NotImplemented
    assert TensorBatch({}).batch_size == 0
    assert TensorBatch({}, batch_size=4).chunk(2)[0].batch_size == 2


def test_fields_can_be_added_and_removed_when_b_agrees():
    batch = TensorBatch({"a": torch.zeros(2)}, metadata={"k": 1})
    batch["b"] = ["x", "y"]
    assert list(batch) == ["a", "b"]
    del batch["a"]
    assert list(batch) == ["b"]
    with pytest.raises(PackedError, match="field 'c' must hold B=2 samples, found 3"):
        batch["c"] = torch.zeros(3)
    with pytest.raises(PackedError, match="field names must be str"):
        batch[0] = torch.zeros(2)  # type: ignore[index]


def test_copy_shares_fields_and_cat_refuses_mixed_dtypes():
    import copy

    batch = TensorBatch({"x": torch.arange(3)}, metadata={"k": 1})
    clone = copy.copy(batch)
    assert clone["x"] is batch["x"]
    assert clone.metadata == {"k": 1}
    with pytest.raises(PackedError, match=r"field 'x' of batch 1 must have dtype torch.int64"):
        TensorBatch.cat([batch, TensorBatch({"x": torch.zeros(2)})])


def test_invalid_batches():
    with pytest.raises(PackedError, match="field 'b' must hold B=2 samples, found 3"):
        TensorBatch({"a": torch.zeros(2), "b": [1, 2, 3]})
    with pytest.raises(
        PackedError, match=r"must be a torch\.Tensor, PackedTensor, PackedRagged or list"
    ):
        TensorBatch({"a": (1, 2)})
    with pytest.raises(PackedError, match="batch dimension"):
        TensorBatch({"a": torch.tensor(1.0)})
    batch = TensorBatch({"a": torch.zeros(2)})
    with pytest.raises(PackedError, match=r"fields \['zz'\] not in batch"):
        batch.select(["zz"])
    with pytest.raises(PackedError, match="chunk count"):
        batch.chunk(0)
    with pytest.raises(PackedError, match="at least one"):
        TensorBatch.cat([])
    with pytest.raises(PackedError, match="must have fields"):
        TensorBatch.cat([batch, TensorBatch({"b": torch.zeros(2)})])
    with pytest.raises(PackedError, match="must have one kind"):
        TensorBatch.cat([batch, TensorBatch({"a": [1, 2]})])
    with pytest.raises(IndexError):
        batch[[5]]
    with pytest.raises(PackedError, match="repeat count: expected an int >= 0, found -1"):
        batch.repeat(-1)
    with pytest.raises(PackedError, match=r"found 1\.5"):
        batch.repeat_interleave(1.5)


# --- metadata across cat and chunk ---------------------------------------------------------


def _described(batch_size: int, offset: int = 0) -> TensorBatch:
    return TensorBatch(
        {"x": torch.arange(offset, offset + batch_size)},
        {
            "step": 4,
            "micro_batch": offset,
            "stats": StitchStats(samples=batch_size, gaps=offset),
            "index": PerSample(range(offset, offset + batch_size)),
            "files": PerSample((f"f{i}",) for i in range(offset, offset + batch_size)),
            "warnings": [f"w{offset}"],
            "dropped_files": ("shared", f"d{offset}"),
        },
    )


def test_cat_merges_metadata_sums_stats_joins_lists_and_drops_disagreements():
    merged = TensorBatch.cat([_described(2), _described(3, offset=2)])
    meta = merged.metadata
    assert meta["step"] == 4  # every part agrees
    assert "micro_batch" not in meta  # the parts differ: no one value is right
    assert meta["stats"] == StitchStats(samples=5, gaps=2)
    assert meta["index"] == PerSample(range(5))
    assert isinstance(meta["index"], PerSample)
    assert meta["warnings"] == ["w0", "w2"]
    assert meta["dropped_files"] == ("shared", "d0", "d2")


@settings(max_examples=30, deadline=None)
@given(batch_size=st.integers(0, 12), parts=st.integers(1, 5), picks=st.lists(st.integers(0, 11)))
def test_chunk_splits_per_sample_metadata_and_cat_puts_it_back(batch_size, parts, picks):
    batch = _described(batch_size)
    chunks = batch.chunk(parts)
    for chunk in chunks:
        assert list(chunk.metadata["index"]) == chunk["x"].tolist()
        assert [f for (f,) in chunk.metadata["files"]] == [f"f{i}" for i in chunk["x"].tolist()]
    assert TensorBatch.cat(chunks) == batch  # fields and metadata
    picks = [p for p in picks if p < batch_size]
    picked = batch.gather(picks)
    assert list(picked.metadata["index"]) == picks
    assert picked.metadata["stats"] == batch.metadata["stats"]  # describes the batch it came from


def test_per_sample_metadata_must_match_the_batch_size():
    with pytest.raises(PackedError, match="metadata 'index' is per sample"):
        TensorBatch({"x": torch.zeros(2)}, {"index": PerSample([0])})


def test_array_metadata_compares_and_merges_by_value():
    """Equal arrays in metadata: ``==`` on two batches raised numpy's "truth value of an
    array is ambiguous", and ``cat`` dropped the value as if the parts disagreed."""

    def batch(scale):
        values = torch.arange(2)
        return TensorBatch({"x": values}, {"scale": np.array([1.0, scale]), "w": torch.ones(2)})

    assert batch(2.0) == batch(2.0)
    assert batch(2.0) != batch(3.0)
    merged = merge_metadata([batch(2.0).metadata, batch(2.0).metadata])
    assert np.array_equal(merged["scale"], [1.0, 2.0])
    assert torch.equal(merged["w"], torch.ones(2))
    assert "scale" not in merge_metadata([batch(2.0).metadata, batch(3.0).metadata])
