"""replay_topk: the drop-in for ``torch.topk`` in non-Megatron routers."""

from __future__ import annotations

import pytest
import torch

from r3data.errors import ReplayError
from r3data.layout import TokenLayout, expand_batch_major
from r3data.packed import PackedTensor
from r3data.replay import replay_topk


def test_replaying_the_routers_own_choice_is_topk():
    scores = torch.randn(10, 8).softmax(dim=1)
    values, indices = torch.topk(scores, 3, dim=1)
    replayed_values, replayed = replay_topk(scores, indices.to(torch.int32))
    assert torch.equal(replayed, indices)
    assert torch.equal(replayed_values, values)


def test_gates_stay_differentiable_at_the_replayed_experts():
    logits = torch.randn(6, 8, requires_grad=True)
    routes = torch.tensor([[7, 0]] * 6, dtype=torch.uint8)
    gates, _ = replay_topk(logits.softmax(dim=1), routes)
    gates.sum().backward()
    assert logits.grad is not None
    assert logits.grad.abs().sum() > 0
    assert torch.allclose(gates, logits.softmax(dim=1)[:, [7, 0]])


def test_batch_major_routes_feed_a_batch_major_router():
    routes = PackedTensor.from_lengths(torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]]]), [2, 1])
    (layer,) = expand_batch_major(routes, TokenLayout(packed=False))
    scores = torch.rand(2 * 2, 8)  # a [B, S, hidden] router flattens batch-major
    _, indices = replay_topk(scores, layer.reshape(-1, 2))
    assert indices.tolist() == [[1, 2], [3, 4], [5, 6], [0, 1]]


@pytest.mark.parametrize(
    ("scores", "indices", "message"),
    [
        (
            torch.rand(4, 8),
            torch.zeros(3, 2, dtype=torch.long),
            r"agree on tokens, found \[4, 8\] and \[3, 2\]",
        ),
        (torch.rand(4), torch.zeros(4, 2, dtype=torch.long), "agree on tokens"),
        (torch.rand(4, 8), torch.zeros(4, 2), "integer expert ids, found torch.float32"),
        (torch.rand(4, 8), torch.full((4, 2), 8), r"in \[0, 8\), found 8"),
        (torch.rand(4, 8), torch.full((4, 2), -2), "found -2"),
    ],
)
def test_bad_indices_raise(scores, indices, message):
    with pytest.raises(ReplayError, match=message):
        replay_topk(scores, indices)
