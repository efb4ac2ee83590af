"""r3data: the MoE router-replay data path from inference servers to trainers."""

from __future__ import annotations

from typing import Any

from r3data.batch import TensorBatch
from r3data.errors import R3DataError
from r3data.packed import PackedTensor

__all__ = ["PackedTensor", "R3DataError", "RolloutDataset", "TensorBatch", "loader"]


def __getattr__(name: str) -> Any:
    """``loader`` and ``RolloutDataset`` load torchdata on first use, so the lower layers
    (wire, payload, trace, layout) import without it."""
    if name in ("loader", "RolloutDataset"):
        from r3data import nodes

        return getattr(nodes, name)
    raise AttributeError(f"module 'r3data' has no attribute {name!r}")
