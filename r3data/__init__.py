"""r3data: the MoE router-replay data path from inference servers to trainers.

Every module logs to ``logging.getLogger(__name__)``; the package logger has a
``NullHandler``, so nothing is printed unless the application configures logging.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import Any

from r3data.errors import R3DataError

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["BatchLoader", "PackedTensor", "R3DataError", "RolloutDataset", "TensorBatch", "loader"]

_LAZY = {
    "PackedTensor": "r3data.packed",
    "TensorBatch": "r3data.batch",
    "BatchLoader": "r3data.nodes",
    "loader": "r3data.nodes",
    "RolloutDataset": "r3data.nodes",
}


def __getattr__(name: str) -> Any:
    """Names that need torch (and torchdata) import it on first use, so that ``r3data
    --help`` and the lower layers (wire, payload, trace) start without it."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'r3data' has no attribute {name!r}")
    return getattr(import_module(module), name)
