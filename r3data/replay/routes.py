"""Replay routes in a router that is not Megatron's (FSDP, torchtitan-style MoE).

Such routers compute ``scores`` ``[tokens, experts]`` and pick ``torch.topk(scores, k)``.
Replaying swaps the pick for the recorded experts and gathers the trainer's own scores at
them, so the gates stay differentiable. Feed it one layer of
:func:`r3data.layout.expand_batch_major` flattened to ``[B * S, topk]`` (batch-major, as such
routers flatten ``[B, S, hidden]``).
"""

from __future__ import annotations

import torch

from r3data.errors import ReplayError

__all__ = ["replay_topk"]


def replay_topk(
    scores: torch.Tensor, indices: torch.Tensor, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores at indices, indices)``: a drop-in for ``torch.topk(scores, k, dim=1)``.

    ``check`` validates the expert ids first (one synchronisation); an out-of-range id would
    otherwise be a device-side assert on a GPU.
    """
    if scores.dim() != 2 or indices.dim() != 2 or scores.shape[0] != indices.shape[0]:
        raise ReplayError(
            f"scores [tokens, experts] and indices [tokens, topk] must agree on tokens, found "
            f"{list(scores.shape)} and {list(indices.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ReplayError(f"indices must hold integer expert ids, found {indices.dtype}")
    indices = indices.to(scores.device, torch.int64)
    if check and indices.numel():
        low, high = torch.stack([indices.min(), indices.max()]).tolist()
        if low < 0 or high >= scores.shape[1]:
            raise ReplayError(
                f"expert ids must be in [0, {scores.shape[1]}), found {low if low < 0 else high}"
            )
    return scores.gather(1, indices), indices
