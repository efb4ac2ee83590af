"""Rank-local rows know their layout: expansion reads it, refuses another, and dense layers are
never replayed as routes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data import TensorBatch, loader
from r3data.errors import ConfigError, LayoutError
from r3data.layout import (
    ModelLayers,
    RankRows,
    TokenLayout,
    expand,
    expand_batch_major,
    expand_mask,
)
from r3data.packed import PackedTensor
from r3data.wire import InlineRows

LAYERS, TOPK, EXPERTS = 3, 2, 16


def local_rows(full: PackedTensor, layout: TokenLayout) -> RankRows:
    """What a rank-local read holds: each sample's ``local_ranges`` rows back to back."""
    ranges = layout.local_ranges(full.lengths)
    rows = PackedTensor.from_segments(
        [
            torch.cat([segment[lo:hi] for lo, hi in sample_ranges] or [segment[:0]])
            for segment, sample_ranges in zip(full, ranges, strict=True)
        ]
    )
    return RankRows(rows.values, rows.offsets, layout=layout, full_lengths=full.lengths)


def routes_of(lengths, seed=0) -> PackedTensor:
    rng = np.random.default_rng(seed)
    values = rng.integers(1, EXPERTS, (sum(lengths), LAYERS, TOPK)).astype(np.uint8)
    return PackedTensor.from_lengths(torch.from_numpy(values), lengths)


layouts = st.builds(
    lambda tp, cp, sp, packed, rank: TokenLayout(
        tp_size=tp,
        tp_rank=rank % tp,
        cp_size=cp,
        cp_rank=rank // tp % cp,
        sequence_parallel=sp and tp > 1,
        packed=packed,
    ),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2, 3]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 11),
)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), layout=layouts)
def test_rank_rows_expand_alone_like_the_full_batch_through_every_batch_operation(lengths, layout):
    full = routes_of(lengths)
    local = local_rows(full, layout)
    want = expand(full, layout)
    for got in (expand(local), expand(local, layout), expand(pickle.loads(pickle.dumps(local)))):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(expand(local.to(dtype=torch.int32)), want, strict=True)
    )
    if not layout.packed:
        batch_major = expand_batch_major(local)
        for a, b in zip(batch_major, expand_batch_major(full, layout), strict=True):
            assert torch.equal(a, b)
    picks = list(range(len(lengths)))[::-1]
    for part, whole in (
        (local[1:], full[1:]),
        (local.gather(picks), full.gather(picks)),
        (RankRows.cat([local[:1], local[1:]]), full),
    ):
        assert isinstance(part, RankRows)
        assert part.full_lengths.tolist() == whole.lengths.tolist()
        if local.per_sample:  # each sample cut on its own: a selection is a batch's read too
            for a, b in zip(expand(part), expand(whole, layout), strict=True):
                assert torch.equal(a, b)
        elif len(part):
            with pytest.raises(LayoutError, match="selected from the micro-batch"):
                expand(part)


def test_rank_local_rows_refuse_another_layout_or_being_taken_for_full_rows():
    lengths = [9, 14, 6]
    layout = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=0)
    local = local_rows(routes_of(lengths), layout)
    other = TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True, cp_size=2, cp_rank=0)
    with pytest.raises(LayoutError, match="expanding them for another layout"):
        expand(local, other)
    with pytest.raises(LayoutError, match="cannot be expanded as full samples"):
        expand(local, layout, local=False)
    with pytest.raises(LayoutError, match="are not the full lengths"):
        expand(local, lengths=local.lengths)
    with pytest.raises(LayoutError, match="are not this layout's share"):
        RankRows(local.values, local.offsets, layout=other, full_lengths=[9, 14, 7])
    valid = local_rows(
        PackedTensor.from_lengths(torch.ones(sum(lengths), dtype=torch.bool), lengths), layout
    )
    assert expand_mask(valid).sum() == sum(local.lengths)
    with pytest.raises(LayoutError, match="another layout"):
        expand_mask(valid, other)
    with pytest.raises(LayoutError, match="only a rank-local batch carries its own"):
        expand(routes_of(lengths))


def test_a_rank_local_batch_from_the_loader_carries_its_layout_and_full_lengths():
    layout = TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True, cp_size=2, cp_rank=1)
    samples = []
    for i, n in enumerate([17, 30, 9, 22]):
        rows = np.random.default_rng(i).integers(1, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
        request = {"prompt_len": 1, "completion_len": n - 1}
        request["sources"] = [InlineRows("routed_experts", rows, 0)]
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    options = {"batch_size": 4, "micro_batches": {"size": 2}}
    full = list(loader(samples, **options))
    local = list(loader(samples, layout=layout, **options))
    for whole, mine in zip(full, local, strict=True):
        routes = mine["routed_experts"]
        assert isinstance(routes, RankRows)
        assert isinstance(mine["routed_experts_valid"], RankRows)
        assert routes.layout == layout
        assert mine.metadata["layout"] == layout
        assert routes.full_lengths.tolist() == mine["token_ids"].lengths.tolist()
        for got, want in zip(expand(routes), expand(whole["routed_experts"], layout), strict=True):
            assert torch.equal(got, want)
        with pytest.raises(LayoutError, match="another layout"):
            expand(routes, TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2))
    step = TensorBatch.cat(local)  # rows read for two micro-batches are no one batch's
    with pytest.raises(LayoutError, match="selected from the micro-batch they were read for"):
        expand(step["routed_experts"])


def test_dense_layers_are_stated_once_and_never_replayed_as_routes():
    lengths = [5, 8]
    full = routes_of(lengths)
    full.values[:, 0] = 0  # layer 0 is dense: engines send zeros for it
    with pytest.raises(LayoutError, match=r"layers \[0\] of the routes are zero in every row"):
        expand_batch_major(full)
    with pytest.raises(LayoutError, match=r"layers \[0\]"):
        expand(full, TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True))
    layers = ModelLayers(num_layers=LAYERS, moe_layer_freq=(0, 1, 1))
    per_layer = expand_batch_major(full, TokenLayout(packed=False, layers=layers))
    assert len(per_layer) == 2
    assert all(int(t[1].min()) > 0 for t in per_layer)  # sample 1 (the longest): no padding
    # stated once, to the loader's layout: a whole-row read carries the pattern along
    carried = RankRows(
        full.values, full.offsets, layout=TokenLayout(layers=layers), full_lengths=lengths
    )
    assert len(expand_batch_major(carried)) == 2
    assert len(expand(carried, TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True))) == 2
    with pytest.raises(LayoutError, match="the routes were read for layers"):
        expand(carried, TokenLayout(layers=ModelLayers(num_layers=LAYERS)))


def test_a_rank_local_read_refuses_to_drop_samples_its_ranks_could_disagree_on():
    """An engine bug found while filling is seen only by the rank reading its rows: under
    ``drop_sample`` the ranks of one micro-batch would train on different samples."""
    rows = np.full((20, LAYERS, TOPK), 3, np.uint8)
    rows[5] = 0  # an engine bug: a row zero in every layer, on some rank's share only
    request = {
        "prompt_len": 1,
        "completion_len": 20,
        "sources": [InlineRows("routed_experts", rows, 0)],
    }
    fine = {"id": "fine", "token_ids": np.arange(21), "requests": [request]}
    split = TokenLayout(cp_size=2, cp_rank=0)
    with pytest.raises(ConfigError, match="could drop different samples"):
        loader([fine], batch_size=1, layout=split, trace={"on_gap": "drop_sample"})
    whole = TokenLayout(tp_size=2, tp_rank=1)  # no sequence split: every rank reads every row
    (batch,) = loader([fine], batch_size=1, layout=whole, trace={"on_gap": "drop_sample"})
    assert batch.batch_size == 0
    assert batch.metadata["dropped"] == ["fine"]
    (kept,) = loader([fine], batch_size=1, layout=split)  # drop_routes: this rank's rows only
    assert isinstance(kept["routed_experts"], RankRows)
