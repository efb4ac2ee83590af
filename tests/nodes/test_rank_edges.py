"""Edges of the data-parallel plan a trainer's ranks must survive: a rank with no sample in a
micro-batch (a short last step, a token budget that one long sample fills alone), whose
forward still runs and still installs one (empty) route tensor per MoE layer."""

from __future__ import annotations

import numpy as np
import pytest
from source_kinds import SOURCES

from r3data import loader
from r3data.errors import TraceError
from r3data.layout import TokenLayout, expand
from r3data.nodes import DataParallel
from r3data.packed_ragged import PackedRagged
from r3data.payload import PayloadWriter
from r3data.wire import InlineRows

LAYERS, TOPK, EXPERTS = 3, 2, 16
FIELDS = ("routed_experts", "sampling_mask")


def masked_samples(root, lengths, rng):
    writer = PayloadWriter(root)
    samples = []
    for i, n in enumerate(lengths):
        prompt = n // 2
        routes = rng.integers(1, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
        masks = [rng.choice(50, 3, replace=False).astype(np.int32) for _ in range(n - prompt)]
        segments = writer.write(
            0,
            {"routed_experts": routes, "sampling_mask": masks},
            pos={"routed_experts": 0, "sampling_mask": prompt},
        )
        request = {"prompt_len": prompt, "completion_len": n - prompt, "sources": segments}
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    return samples


@pytest.mark.parametrize(
    ("layout", "micro"),
    [
        (None, {"size": 1}),  # a short last step: 3 samples over 2 ranks
        (TokenLayout(cp_size=2, cp_rank=1), {"size": 1}),
        (TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True), {"max_tokens": 16}),
    ],
)
def test_an_empty_micro_batch_keeps_every_field_s_form(tmp_path, layout, micro):
    samples = masked_samples(tmp_path, [9, 12, 16], np.random.default_rng(0))
    options = {
        "batch_size": 4,
        "micro_batches": micro,
        "layout": layout,
        "num_experts": EXPERTS,
        "payload_root": tmp_path,
        "collate": {"fields": FIELDS, "workers": 1},
    }
    ranks = [
        list(loader(samples, data_parallel=DataParallel(rank=r, size=2), **options))
        for r in range(2)
    ]
    assert [len(r) for r in ranks] == [2, 2]
    empty = [b for r in ranks for b in r if not b["sample_id"]]
    full = [b for r in ranks for b in r if b["sample_id"]]
    assert len(empty) == 1
    (batch,) = empty
    routes, masks = batch["routed_experts"], batch["sampling_mask"]
    assert routes.row_shape == full[0]["routed_experts"].row_shape == (LAYERS, TOPK)
    assert routes.dtype == full[0]["routed_experts"].dtype
    lay = layout or TokenLayout()
    per_layer = expand(routes) if layout is not None else expand(routes, lay)
    assert [tuple(t.shape) for t in per_layer] == [(0, TOPK)] * LAYERS
    assert isinstance(masks, PackedRagged)
    assert isinstance(full[0]["sampling_mask"], PackedRagged)
    assert masks.dtype == full[0]["sampling_mask"].dtype
    assert len(masks) == len(batch["sampling_mask_valid"]) == 0


@pytest.mark.parametrize("kind", sorted(SOURCES))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_state_saved_after_a_short_last_step_resumes_to_nothing(tmp_path, kind, prefetch):
    """A checkpoint at the end of the data (its last step short) resumes to no micro-batch:
    not a ConfigError from fast-forwarding past the end, not the data over again."""
    samples = masked_samples(tmp_path, [9, 12, 16, 7, 5], np.random.default_rng(1))
    options = {
        "batch_size": 4,
        "micro_batches": {"size": 1},
        "data_parallel": DataParallel(rank=1, size=2),
        "payload_root": tmp_path,
        "prefetch": prefetch,
        "collate": {"workers": 1},
    }
    first = loader(SOURCES[kind](samples), **options)
    got = list(first)
    assert [b.metadata["step"] for b in got] == [0, 0, 1]  # step 1: one sample, on rank 0
    resumed = loader(SOURCES[kind](samples), **options)
    resumed.load_state_dict(first.state_dict())
    assert list(resumed) == []


def with_gap(samples, index):
    """Sample ``index`` with an all-zero engine row (a gap the screen finds)."""
    request = dict(samples[index]["requests"][0])
    routes = request["sources"][0]
    rows = np.zeros((routes.rows, LAYERS, TOPK), np.uint8) + 3
    rows[2] = 0
    request["sources"] = [InlineRows("routed_experts", rows, routes.pos), *request["sources"][1:]]
    return [*samples[:index], {**samples[index], "requests": [request]}, *samples[index + 1 :]]


OPTION_SETS = {
    "masks, CP": {
        "layout": TokenLayout(cp_size=2, cp_rank=1),
        "collate": {"fields": FIELDS, "workers": 1},
    },
    "masks, SP, BSHD": {
        "layout": TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True, packed=False),
        "collate": {"fields": FIELDS, "workers": 2},
        "micro_batches": {"max_tokens": 20},
    },
    "drop_sample": {"trace": {"on_gap": "drop_sample"}, "micro_batches": {"size": 1}},
    "distinct, zero rows kept": {
        "trace": {"placeholder": "distinct"},
        "screen": {"zero_rows": "keep"},
        "shuffle": True,
        "drop_last": True,
    },
    "start_step, no num_experts": {"start_step": 7, "num_experts": None},
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_a_state_saved_after_any_micro_batch_resumes_under_every_option(tmp_path, name):
    rng = np.random.default_rng(2)
    samples = with_gap(masked_samples(tmp_path, [9, 12, 16, 7, 5, 11, 6], rng), 2)
    options = {
        "batch_size": 4,
        "data_parallel": DataParallel(rank=0, size=2),
        "micro_batches": {"size": 1},
        "num_experts": EXPERTS,
        "payload_root": tmp_path,
        "collate": {"workers": 1},
        **OPTION_SETS[name],
    }
    full = list(loader(samples, prefetch=0, **options))
    assert full
    for cut in range(len(full) + 1):
        first = loader(samples, prefetch=2, **options)
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = first.state_dict()
        resumed = loader(samples, prefetch=1, **options)
        resumed.load_state_dict(state)
        assert list(resumed) == full[cut:], cut


def test_an_empty_micro_batch_takes_its_form_past_another_rank_s_bad_sample(tmp_path):
    """The bad sample is its owner's to report: the rank short of samples still gets its
    empty micro-batch, in the form of the step's next sample."""
    samples = masked_samples(tmp_path, [9, 12, 16], np.random.default_rng(3))
    del samples[0]["requests"][0]["prompt_len"]  # s0 goes to rank 1
    options = {
        "batch_size": 4,
        "micro_batches": {"size": 1},
        "payload_root": tmp_path,
        "collate": {"fields": FIELDS, "workers": 1},
    }
    shorter = list(loader(samples, data_parallel=DataParallel(rank=0, size=2), **options))
    assert [b["sample_id"] for b in shorter] == [["s2"], []]
    assert shorter[1]["routed_experts"].row_shape == (LAYERS, TOPK)
    owner = iter(loader(samples, data_parallel=DataParallel(rank=1, size=2), **options))
    with pytest.raises(TraceError, match=r"sample 's0' \(index 0\): request 0: expected a dict"):
        next(owner)


def test_a_field_no_sample_has_leaves_the_other_fields_their_form(tmp_path):
    """A step whose samples all lack their masks (greedy: no kept sets) keeps them, with
    empty, invalid mask rows; a rank's empty micro-batch keeps ``[layers, topk]`` route rows
    from the samples that have them (the forward still runs) and a ragged mask field."""
    samples = masked_samples(tmp_path, [9, 12, 16], np.random.default_rng(4))
    for sample in samples:
        request = sample["requests"][0]
        request["sources"] = [s for s in request["sources"] if s.field == "routed_experts"]
    options = {
        "batch_size": 4,
        "micro_batches": {"size": 1},
        "num_experts": EXPERTS,
        "payload_root": tmp_path,
        "collate": {"fields": FIELDS, "workers": 1},
    }
    shares = []
    for rank in range(2):
        batches = list(loader(samples, data_parallel=DataParallel(rank=rank, size=2), **options))
        shares.append([b["sample_id"] for b in batches])
        for batch in batches:
            assert isinstance(batch["sampling_mask"], PackedRagged)
            assert batch["sampling_mask"].values.numel() == 0
            assert not batch["sampling_mask_valid"].values.any()
            assert batch["routed_experts"].row_shape == (LAYERS, TOPK)
            tokens = int(batch["routed_experts"].total_rows)  # 0 in an empty micro-batch
            assert [tuple(t.shape) for t in expand(batch["routed_experts"], TokenLayout())] == [
                (tokens, TOPK)
            ] * LAYERS
    assert sorted(sid for share in shares for micro in share for sid in micro) == ["s0", "s1", "s2"]
    assert [] in shares[0] + shares[1]  # a rank's empty micro-batch is among them
