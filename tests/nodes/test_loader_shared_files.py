"""A payload file holding samples of different steps (a GRPO group written together) is kept
until the last step that reads it, whatever the threads and prefetch depth; never early."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from r3data import loader
from r3data.errors import ConfigError
from r3data.layout import TokenLayout
from r3data.nodes import DataParallel, MicroBatches
from r3data.payload import PayloadRetention, PayloadWriter, shift

LAYERS, TOPK, EXPERTS = 2, 2, 16


def group_samples(root, rng, count=8, tokens=6):
    """``count`` samples whose rows sit in one payload file, plus a file of their own each."""
    writer = PayloadWriter(root)
    shared_rows = rng.integers(0, EXPERTS, (count, tokens - 1, LAYERS, TOPK)).astype(np.uint8)
    (group,) = writer.write(0, {"routed_experts": shared_rows.reshape(-1, LAYERS, TOPK)})
    samples, expected = [], []
    for i in range(count):
        own = rng.integers(0, EXPERTS, (3, LAYERS, TOPK)).astype(np.uint8)
        (mine,) = writer.write(0, {"routed_experts": own}, pos=tokens - 1)
        rows = (tokens - 1) * i
        first = {
            "prompt_len": 3,
            "completion_len": tokens - 3,
            "sources": [shift([group.clipped(rows, rows + tokens - 1)], -rows)[0].to_dict()],
        }
        second = {"prompt_len": tokens + 1, "completion_len": 2, "sources": [mine.to_dict()]}
        samples.append(
            {"id": f"g{i}", "token_ids": np.arange(tokens + 3), "requests": [first, second]}
        )
        expected.append(np.concatenate([shared_rows[i], own, own[-1:]]))
    return samples, expected, group.file


@pytest.mark.parametrize(("workers", "prefetch"), list(itertools.product([1, 2], [0, 1, 2])))
def test_a_late_sample_reads_a_file_shared_with_an_earlier_step(tmp_path, workers, prefetch):
    samples, expected, shared = group_samples(tmp_path, np.random.default_rng(workers + prefetch))
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=8, fresh=False)
    batches = loader(
        samples,
        batch_size=2,
        micro_batches=MicroBatches(size=1),
        retention=retention,
        prefetch=prefetch,
        collate={"workers": workers},
    )
    read = 0
    for batch in batches:
        (i,) = batch.metadata["index"]
        assert np.array_equal(batch["routed_experts"][0].numpy(), expected[i])  # never missing
        read += 1
        if batch.metadata["micro_batch"] + 1 == batch.metadata["micro_batches"]:
            step = batch.metadata["step"]
            retention.on_policy_update(step)
            retention.wait()  # deletions done before the next step is read
            own = {f for files in batch.metadata["files"] for f in files} - {shared}
            assert not any((tmp_path / f).exists() for f in own)
            assert (tmp_path / shared).exists() == (step < 3)  # the last step reading it is 3
    assert read == len(samples)
    assert retention.metrics().files_deleted == len(samples) + 1
    retention.close()


def test_several_ranks_on_one_root_need_a_retention_group(tmp_path):
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=1, fresh=False)
    with pytest.raises(ConfigError, match="several ranks read this payload root"):
        loader([], batch_size=2, data_parallel=DataParallel(rank=1, size=2), retention=retention)
    layout = TokenLayout(cp_size=2, cp_rank=1)
    with pytest.raises(ConfigError, match="give every rank PayloadRetention"):
        loader([], batch_size=2, layout=layout, retention=retention)
    with pytest.raises(ConfigError, match=r"needs an initialised torch\.distributed"):
        PayloadRetention(str(tmp_path), max_off_policy_steps=1, fresh=False, group=object())
