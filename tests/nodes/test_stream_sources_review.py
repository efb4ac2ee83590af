"""Which sources are streams (read once, in order; files claimed as each sample is stitched
and left to the version sweep) and which are map-style (indexed; every file claimed up front,
deleted at the update of the last step that reads it)."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import IterableDataset
from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

from r3data import loader
from r3data.payload import PayloadRetention, PayloadWriter

LAYERS, TOPK, EXPERTS = 2, 2, 8
PROMPT, COMPLETION = 4, 4


class SizedStream(IterableDataset):
    """An ``IterableDataset`` with a length (for progress bars), which ``torch``'s ``Dataset``
    gives a ``__getitem__`` that raises: it is no map-style source."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)

    def __len__(self):
        return len(self.samples)


def samples_on(root, count):
    writer, rng = PayloadWriter(root), np.random.default_rng(0)
    out, rows = [], {}
    for i in range(count):
        routes = rng.integers(1, EXPERTS, (PROMPT + COMPLETION - 1, LAYERS, TOPK)).astype(np.uint8)
        (segment,) = writer.write(0, {"routed_experts": routes})
        request = {"prompt_len": PROMPT, "completion_len": COMPLETION, "sources": [segment]}
        out.append(
            {"id": f"s{i}", "token_ids": np.arange(PROMPT + COMPLETION), "requests": [request]}
        )
        rows[f"s{i}"] = (routes, segment.file)
    return out, rows


@pytest.mark.parametrize("with_retention", [False, True])
def test_a_sized_iterable_dataset_is_read_as_a_stream(tmp_path, with_retention):
    """It was taken for a map-style source: indexing it raised an untyped
    NotImplementedError (under retention, in the up-front claim of every file)."""
    samples, rows = samples_on(tmp_path, 4)
    retention = PayloadRetention(str(tmp_path), 1, fresh=False) if with_retention else None
    seen = []
    options = {"batch_size": 2, "retention": retention, "payload_root": tmp_path, "prefetch": 0}
    for batch in loader(SizedStream(samples), **options):
        step = batch.metadata["step"]
        for i, sample_id in enumerate(batch["sample_id"]):
            routes, _ = rows[sample_id]
            np.testing.assert_array_equal(batch["routed_experts"][i].numpy()[:-1], routes)
            seen.append(sample_id)
        if retention is not None:
            retention.on_policy_update(step)
            retention.wait()
            # a stream's files go by the sweep (version 0 is off policy after step 1), not
            # at their own step's update
            left = {sid for sid, (_, file) in rows.items() if (tmp_path / file).exists()}
            assert left == (set(rows) if step == 0 else set())
    assert seen == ["s0", "s1", "s2", "s3"]
    if retention is not None:
        assert retention.metrics().files_deleted == 4
        retention.close()


SOURCES = {
    "list": (list, False),
    "StatefulDataLoader": (lambda s: StatefulDataLoader(SizedStream(s), batch_size=None), True),
    "IterableWrapper": (IterableWrapper, True),
    "generator": (lambda s: (x for x in s), True),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_streams_leave_their_files_to_the_sweep_map_style_sources_delete_on_consume(tmp_path, kind):
    """A map-style source's files go at the update of their step (claimed up front); a
    stream's stay past it (a later sample may name them) until their version is off policy."""
    samples, rows = samples_on(tmp_path, 4)
    make, stream = SOURCES[kind]
    retention = PayloadRetention(str(tmp_path), 1, fresh=False)
    options = {"batch_size": 2, "retention": retention, "payload_root": tmp_path, "prefetch": 1}
    for batch in loader(make(samples), **options):
        step = batch.metadata["step"]
        retention.on_policy_update(step)
        retention.wait()
        mine = {rows[sid][1] for sid in batch["sample_id"]}
        assert all((tmp_path / f).exists() == (stream and step == 0) for f in mine)
    assert retention.metrics().files_deleted == 4
    assert retention.metrics().files_claimed == 0
    retention.close()
