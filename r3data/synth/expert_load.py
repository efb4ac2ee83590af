"""Expert load: how often each expert of each MoE layer is named by a batch of route rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3data.errors import WireFormatError
from r3data.nodes.screen import dense_layers

__all__ = ["expert_load"]

CHUNK_ROWS = 1 << 16
"""Rows counted at a time, bounding the int64 scratch space."""


def expert_load(
    routes: np.ndarray, num_experts: int | None = None, layers: Sequence[int] | None = None
) -> tuple[np.ndarray, tuple[int, ...]]:
    """``(counts, layers)``: ``counts[i, e]`` is how many rows name expert ``e`` in MoE layer
    ``layers[i]`` of ``routes`` ``[rows, layers, topk]``. By default every layer that is not
    zero in every row (dense layers, as engines report them); ``num_experts`` defaults to the
    largest id + 1."""
    if routes.ndim != 3 or routes.dtype.kind not in "iu":
        raise WireFormatError(
            f"expert_load: expected integer routes [rows, layers, topk], found shape "
            f"{routes.shape} of {routes.dtype}"
        )
    if layers is None:
        dense = set(dense_layers(routes))
        layers = [layer for layer in range(routes.shape[1]) if layer not in dense]
    layers = tuple(int(layer) for layer in layers)
    largest = int(routes.max()) if routes.size else -1
    experts = largest + 1 if num_experts is None else num_experts
    if largest >= experts or (routes.size and int(routes.min()) < 0):
        raise WireFormatError(
            f"expert_load: expected expert ids in [0, {experts}), found [{int(routes.min())}, "
            f"{largest}]"
        )
    counts = np.zeros(len(layers) * experts, dtype=np.int64)
    shift = (np.arange(len(layers), dtype=np.int64) * experts)[None, :, None]
    for lo in range(0, routes.shape[0], CHUNK_ROWS):
        ids = routes[lo : lo + CHUNK_ROWS][:, list(layers)].astype(np.int64) + shift
        counts += np.bincount(ids.reshape(-1), minlength=counts.size)
    return counts.reshape(len(layers), experts), layers
