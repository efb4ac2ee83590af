"""A ragged field (sampling masks) that some samples of a batch never sent: those samples keep
their routes and get empty, invalid rows, which must not change the batch's dtype (the samples
that sent masks decide it; int32 when none did), so that every batch pads, concatenates and
reads its by-handle masks as one with all masks would."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3data import loader
from r3data.batch import TensorBatch
from r3data.errors import ConfigError
from r3data.layout import TokenLayout
from r3data.nodes import DataParallel, TraceOptions
from r3data.payload import PayloadWriter
from r3data.ragged import RaggedRows
from r3data.trace import TraceBuilder
from r3data.wire import InlineRows

LAYERS, TOPK, EXPERTS = 2, 2, 8
FIELDS = ("routed_experts", "sampling_mask")
MASK_DTYPES = (np.int8, np.int16, np.uint16, np.int32, np.int64)


def rollout(name, n, rng, *, mask_dtype=None, writer=None):
    """A one-turn sample of ``n`` tokens (prompt ``n // 2``); masks of ``mask_dtype`` (None:
    the body sent none), inline or, with a ``writer``, by handle with the routes. Returns the
    sample and its expected mask rows (one list of ids per token)."""
    prompt = n // 2
    routes = rng.integers(1, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
    sources = [InlineRows("routed_experts", routes, 0)]
    expected = [[] for _ in range(n)]
    if mask_dtype is not None:
        masks = [
            np.sort(rng.choice(50, int(rng.integers(0, 4)), replace=False)).astype(mask_dtype)
            for _ in range(n - prompt)
        ]
        for i, row in enumerate(masks):
            expected[prompt + i] = row.tolist()
        if writer is not None:
            fields = {"routed_experts": routes, "sampling_mask": masks}
            sources = writer.write(0, fields, pos={"routed_experts": 0, "sampling_mask": prompt})
        else:
            sources.append(
                InlineRows("sampling_mask", RaggedRows.from_rows(masks, mask_dtype), prompt)
            )
    request = {"prompt_len": prompt, "completion_len": n - prompt, "sources": sources}
    sample = {"id": name, "token_ids": np.arange(n), "requests": [request]}
    return sample, expected, routes


def mask_rows(masks, i):
    rows = masks.segment(i)
    return [rows.values[rows.offsets[j] : rows.offsets[j + 1]].tolist() for j in range(rows.rows)]


@pytest.mark.parametrize("by_handle", [False, True])
@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_a_sample_without_masks_keeps_the_batch_dtype_of_the_masks_sent(tmp_path, dtype, by_handle):
    """int8 masks beside a sample that sent none were widened to int16 (a uint8 form took part
    in the dtype), and by handle the batch then failed: its segments must match the dtype."""
    rng = np.random.default_rng(1)
    writer = PayloadWriter(tmp_path) if by_handle else None
    masked, expected, _ = rollout("masked", 10, rng, mask_dtype=dtype, writer=writer)
    plain, _, routes = rollout("plain", 9, rng)
    options = {"batch_size": 2, "prefetch": 0, "payload_root": tmp_path}
    (batch,) = loader([masked, plain], collate={"fields": FIELDS, "workers": 1}, **options)
    masks = batch["sampling_mask"]
    assert masks.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype
    assert mask_rows(masks, 0) == expected
    assert mask_rows(masks, 1) == [[]] * 9
    assert not batch["sampling_mask_valid"][1].numpy().any()
    np.testing.assert_array_equal(batch["routed_experts"][1].numpy()[:8], routes)


def test_a_batch_no_sample_of_which_sent_masks_pads_and_joins_the_others(tmp_path):
    """Masks of a micro-batch of greedy samples were uint8: ``.padded()`` (fill -1) raised, and
    ``TensorBatch.cat`` with a micro-batch of int32 masks refused the mixed dtypes."""
    rng = np.random.default_rng(2)
    samples, expected = [], []
    for i, dtype in enumerate([None, None, np.int32, np.int32]):
        sample, rows, _ = rollout(f"s{i}", 8 + i, rng, mask_dtype=dtype)
        samples.append(sample)
        expected.append(rows)
    options = {"batch_size": 4, "micro_batches": {"size": 2}, "prefetch": 0}
    greedy, sampled = loader(samples, collate={"fields": FIELDS, "workers": 1}, **options)
    assert greedy["sampling_mask"].dtype == sampled["sampling_mask"].dtype == torch.int32
    padded = greedy["sampling_mask"].padded()
    assert padded.values.shape == (8 + 9, 0)
    joined = TensorBatch.cat([greedy, sampled])
    assert [mask_rows(joined["sampling_mask"], i) for i in range(4)] == expected


def test_an_empty_micro_batch_of_a_step_without_masks_pads(tmp_path):
    """A rank with no sample of its own in a step none of whose samples sent masks: its
    ragged form is int32 too, and pads."""
    rng = np.random.default_rng(3)
    samples = [rollout(f"s{i}", 9, rng)[0] for i in range(3)]
    options = {"batch_size": 4, "micro_batches": {"size": 1}, "prefetch": 0}
    collate = {"fields": FIELDS, "workers": 1}
    batches = [
        b
        for rank in range(2)
        for b in loader(
            samples, data_parallel=DataParallel(rank=rank, size=2), collate=collate, **options
        )
    ]
    assert [] in [b["sample_id"] for b in batches]
    for batch in batches:
        assert batch["sampling_mask"].dtype == torch.int32
        assert batch["sampling_mask"].padded().values.shape[1] == 0


LAYOUTS = st.sampled_from(
    [
        None,
        TokenLayout(cp_size=2, cp_rank=0),
        TokenLayout(cp_size=2, cp_rank=1),
        TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True),
        TokenLayout(cp_size=2, cp_rank=1, tp_size=2, tp_rank=0, sequence_parallel=True),
        TokenLayout(cp_size=2, cp_rank=1, packed=False, padding_side="left"),
    ]
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kinds=st.lists(st.sampled_from(["none", "inline", "handle"]), min_size=1, max_size=4),
    lengths=st.lists(st.integers(2, 12), min_size=4, max_size=4),
    dtype=st.sampled_from(MASK_DTYPES),
    layout=LAYOUTS,
    seed=st.integers(0, 2**16),
)
def test_mixed_batches_match_a_reference(tmp_path_factory, kinds, lengths, dtype, layout, seed):
    """Samples with masks inline, by handle or none, on any rank-local layout: each rank's rows
    are the reference's rows at its local ranges, valid where a mask was sent and not empty;
    the dtype is the masks' (int32 when none was sent)."""
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp("root")
    writer = PayloadWriter(root)
    samples, expected = [], []
    for i, kind in enumerate(kinds):
        sample, rows, _ = rollout(
            f"s{i}",
            lengths[i],
            rng,
            mask_dtype=None if kind == "none" else dtype,
            writer=writer if kind == "handle" else None,
        )
        samples.append(sample)
        expected.append(rows)
    options = {"batch_size": len(samples), "prefetch": 0, "payload_root": root, "layout": layout}
    (batch,) = loader(samples, collate={"fields": FIELDS, "workers": 1}, **options)
    masks, valid = batch["sampling_mask"], batch["sampling_mask_valid"]
    sent = any(kind != "none" for kind in kinds)
    assert masks.dtype == torch.from_numpy(np.zeros(0, dtype if sent else np.int32)).dtype
    full = np.array([len(rows) for rows in expected], np.int64)
    ranges = [[(0, int(n))] for n in full] if layout is None else layout.local_ranges(full)
    for i, rows in enumerate(expected):
        local = [rows[j] for lo, hi in ranges[i] for j in range(lo, hi)]
        assert mask_rows(masks, i) == local
        assert valid[i].numpy().tolist() == [bool(row) for row in local]


def test_the_routes_field_cannot_be_ragged():
    """Routes named ragged were filled as CSR, never screened (an id above num_experts went
    through) and, narrowed to num_experts' dtype, failed with an untyped TypeError; a sample
    without routes would have been kept with none."""
    with pytest.raises(
        ConfigError,
        match=r"ragged_fields: expected fields other than the "
        r"routes field 'routed_experts', found \('routed_experts',\)",
    ):
        TraceOptions(ragged_fields=("routed_experts",))
    with pytest.raises(ConfigError, match=r"found \('sampling_mask', 'r'\)"):
        TraceOptions(routes_field="r", ragged_fields=("sampling_mask", "r"))
    with pytest.raises(ConfigError, match=r"routes field 'routed_experts'"):
        TraceBuilder("t", ragged_fields=("routed_experts",))
    assert TraceBuilder("t", ragged_fields="sampling_mask").ragged_fields == {"sampling_mask"}


def test_a_field_sent_ragged_but_not_named_ragged_drops_a_sample_without_it():
    """Only ``ragged_fields`` are known ragged where nothing was sent: a sample missing another
    field sent ragged elsewhere has no form for it, and is dropped as for any field."""
    rng = np.random.default_rng(5)
    with_support, expected, _ = rollout("with", 8, rng, mask_dtype=np.int32)
    source = with_support["requests"][0]["sources"][1]
    with_support["requests"][0]["sources"][1] = InlineRows("support", source.array, source.pos)
    without, _, _ = rollout("without", 9, rng)
    collate = {"fields": ("routed_experts", "support"), "workers": 1}
    (batch,) = loader([with_support, without], batch_size=2, prefetch=0, collate=collate)
    assert batch["sample_id"] == ["with"]
    assert batch.metadata["dropped"] == ["without"]
    assert mask_rows(batch["support"], 0) == expected
    options = {"ragged_fields": ("sampling_mask", "support")}
    (batch,) = loader(
        [with_support, without], batch_size=2, prefetch=0, collate=collate, trace=options
    )
    assert batch["sample_id"] == ["with", "without"]
    assert mask_rows(batch["support"], 1) == [[]] * 9
