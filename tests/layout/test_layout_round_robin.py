"""``fill=RoundRobin(E)``: padding rows spread over all experts by their place in the padded
batch, on every rank, while real rows stay what ``expand`` gives them."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import PAD, rank_rows, round_up

from r3data.errors import LayoutError
from r3data.layout import ModelLayers, RoundRobin, TokenLayout, expand, expand_batch_major
from r3data.packed import PackedTensor

CASES = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2]),
        "cp": st.sampled_from([1, 2]),
        "sp": st.booleans(),
        "packed": st.booleans(),
        "side": st.sampled_from(["left", "right"]),
        "lengths": st.lists(st.integers(0, 20), min_size=1, max_size=4),
        "topk": st.integers(1, 3),
        "experts": st.integers(3, 9),
    }
)


def ranks(case) -> list[TokenLayout]:
    return [
        TokenLayout(
            tp_size=case["tp"],
            tp_rank=t,
            cp_size=case["cp"],
            cp_rank=c,
            sequence_parallel=case["sp"],
            packed=case["packed"],
            padding_side="right" if case["packed"] else case["side"],
            layers=ModelLayers(num_layers=1),  # random ids may zero a row: say it is MoE
        )
        for c in range(case["cp"])
        for t in range(case["tp"])
    ]


def padded_places(layout: TokenLayout, lengths: list[int]) -> list[int]:
    """Every local token's place in the padded batch, from the reference token order of a
    batch whose samples are all already padded (so no slot is padding)."""
    multiple = layout.multiple
    if layout.packed:
        padded = [round_up(n, multiple) for n in lengths]
    else:
        padded = [round_up(max(lengths, default=0), multiple)] * len(lengths)
    return rank_rows(layout, padded)


@settings(max_examples=60, deadline=None)
@given(CASES)
def test_padding_rows_go_round_robin_by_place_and_real_rows_are_unchanged(case):
    lengths, topk, experts = case["lengths"], case["topk"], case["experts"]
    values = torch.randint(0, experts, (sum(lengths), 1, topk), dtype=torch.uint8)
    routes = PackedTensor.from_lengths(values, lengths)
    places_seen = Counter()
    for layout in ranks(case):
        (spread,) = expand(routes, layout, fill=RoundRobin(experts))
        (distinct,) = expand(routes, layout)
        rows = rank_rows(layout, lengths)
        places = padded_places(layout, lengths)
        for token, (row, place) in enumerate(zip(rows, places, strict=True)):
            if row != PAD:
                assert torch.equal(spread[token], distinct[token])
                continue
            expected = [(place * topk + i) % experts for i in range(topk)]
            assert spread[token].tolist() == expected
            assert len(set(expected)) == topk
            if case["sp"] or layout.tp_rank == 0:
                places_seen[place] += 1
    assert all(count == 1 for count in places_seen.values())  # no place on two ranks


def test_batch_major_form_spreads_padding_the_same_way_and_balances_experts():
    lengths, topk, experts = [3, 10, 1, 7], 2, 6
    routes = PackedTensor.from_lengths(
        torch.zeros(sum(lengths), 1, topk, dtype=torch.uint8), lengths
    )
    one_moe_layer = TokenLayout(packed=False, layers=ModelLayers(num_layers=1))  # zeros: MoE
    (tensor,) = expand_batch_major(routes, one_moe_layer, fill=RoundRobin(experts))  # [B, 10, k]
    places = torch.arange(tensor.shape[0] * tensor.shape[1]).view(tensor.shape[:2])
    pads = torch.from_numpy(np.arange(10)[None, :] >= np.array(lengths)[:, None])
    expected = (places[pads, None] * topk + torch.arange(topk)) % experts
    assert torch.equal(tensor[pads].long(), expected)
    load = torch.bincount(tensor[pads].reshape(-1).long(), minlength=experts)
    assert int(load.max() - load.min()) <= 1  # spread, not piled on experts 0..topk-1


def test_round_robin_needs_enough_experts_and_a_valid_count():
    routes = PackedTensor.from_lengths(torch.zeros(2, 1, 3, dtype=torch.uint8), [2])
    with pytest.raises(LayoutError, match="top-3 distinct experts of 2"):
        expand(routes, TokenLayout(pad_multiple=4), fill=RoundRobin(2))
    with pytest.raises(LayoutError, match="num_experts: expected an int >= 1, found 0"):
        RoundRobin(0)
