"""Route shapes of public MoE models: what one token's route row looks like for each.

The numbers come from each model's public ``config.json``: ``num_hidden_layers``, the routed
experts (``num_experts`` / ``n_routed_experts``), ``num_experts_per_tok`` and the leading dense
layers (``first_k_dense_replace``; Qwen3-30B-A3B has none). Engines report one entry per decoder
layer, dense layers as all-zero rows, in uint8 up to 256 experts and uint16 above (vLLM's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3data.errors import ConfigError
from r3data.layout import ModelLayers
from r3data.wire.dtypes import compact_route_dtype

__all__ = ["MODEL_SHAPES", "ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The routing geometry of one MoE model."""

    name: str
    num_layers: int
    num_experts: int
    topk: int
    dense_layers: int = 0
    """Leading decoder layers with a dense MLP (no router)."""

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the layers that have a router."""
        return tuple(range(self.dense_layers, self.num_layers))

    @property
    def layers(self) -> ModelLayers:
        """The decoder layers as :mod:`r3data.layout` sees them (MoE flags per layer)."""
        flags = tuple(int(i >= self.dense_layers) for i in range(self.num_layers))
        return ModelLayers(num_layers=self.num_layers, moe_layer_freq=flags)

    @property
    def route_dtype(self) -> np.dtype:
        """The dtype an engine reports expert ids in."""
        return compact_route_dtype(self.num_experts - 1)

    @property
    def row_shape(self) -> tuple[int, int]:
        """One token's route row as engines report it: every decoder layer x top-k."""
        return (self.num_layers, self.topk)

    @property
    def route_bytes_per_token(self) -> int:
        return self.num_layers * self.topk * self.route_dtype.itemsize


MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("qwen3-30b-a3b", num_layers=48, num_experts=128, topk=8),
        ModelShape("glm-4.5-air", num_layers=46, num_experts=128, topk=8, dense_layers=1),
        ModelShape("deepseek-v3", num_layers=61, num_experts=256, topk=8, dense_layers=3),
        ModelShape("kimi-k2", num_layers=61, num_experts=384, topk=8, dense_layers=1),
    )
}


def model_shape(name: str) -> ModelShape:
    """The shape registered under ``name``."""
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ConfigError(
            f"model shape must be one of {sorted(MODEL_SHAPES)}, found {name!r}"
        ) from None
