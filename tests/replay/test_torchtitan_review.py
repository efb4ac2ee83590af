"""Adversarial review of torchtitan replay: the group-limited router's own scores decide the
score threshold, and routes a router would never pick are refused before the forward."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import token_batch
from test_torchtitan_moe_layer import TOPK, Decoder  # skips without torchtitan

from r3data import PackedTensor
from r3data.errors import ReplayError
from r3data.replay import hf_inputs
from r3data.replay.torchtitan import record, replay

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def test_threshold_scores_replayed_experts_outside_the_trainers_groups():
    # layer 1's sigmoid router keeps 1 of 2 groups (experts 0-3, 4-7), masking the other
    # with -inf before its top-k; the threshold compares the trainer's own sigmoid scores
    model = Decoder()
    lengths = (5, 4)
    inputs = hf_inputs(token_batch(lengths))
    rows = torch.tensor([[0, 4]], dtype=torch.uint8).expand(9, -1)  # one expert per group
    routes = PackedTensor.from_lengths(rows.unsqueeze(1).repeat(1, 2, 1), list(lengths))
    with (
        torch.no_grad(),
        replay(model, routes, inputs, threshold=1e-6) as session,
        record(model, inputs) as used,
    ):
        model(inputs["input_ids"])
    assert session.agreement.replaced == (0.0, 0.0)  # every sigmoid score > 1e-6 x weakest
    assert torch.equal(used.routes.values, routes.values)


def test_torchtitan_refuses_a_row_that_repeats_an_expert():
    model = Decoder()
    lengths = (5, 4)
    inputs = hf_inputs(token_batch(lengths))
    values = torch.tensor([[0, 4]], dtype=torch.uint8).expand(9, 2, TOPK).clone()
    values[3, 0] = torch.tensor([2, 2])
    with (
        pytest.raises(ReplayError, match=r"layer 0's router .* \[2, 2\] at row 3"),
        replay(model, PackedTensor.from_lengths(values, list(lengths)), inputs),
    ):
        model(inputs["input_ids"])
