"""Hugging Face model inputs from a batch, laid out exactly as its routes are replayed.

:func:`hf_inputs` turns a batch's packed ``token_ids`` into ``input_ids``,
``attention_mask`` and ``position_ids`` (padded ``[B, S]``), or a packed ``[1, N]`` stream
with per-sample ``position_ids`` and no mask (transformers' packed-sequence form: where the
model hands ``position_ids`` to its mask builders they derive the block-diagonal causal mask
from the position restarts, and flash attention reads the same restarts; families that do
not, GPT-OSS's and the hybrids' among them, would mix the samples, and ``replay`` and
``record`` refuse them the packed form). The result is a mapping for ``model(**inputs)`` that
also knows the packed row of every model token, so routes, masks and per-token fields lay
out the same way (:meth:`HFInputs.pad`) and recorded routes go back to packed form
(:meth:`HFInputs.unpad`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from r3data.batch import TensorBatch
from r3data.errors import ReplayError
from r3data.layout import PAD, Fill, ModelLayers, TokenLayout, expand, expand_batch_major
from r3data.packed import PackedTensor, aranges

__all__ = ["HFInputs", "hf_inputs"]


@dataclass(frozen=True, eq=False)
class HFInputs(Mapping[str, Any]):
    """``input_ids``, ``attention_mask`` (padded form only) and ``position_ids`` for
    ``model(**inputs)`` (with ``use_cache=False``), plus where every model token came from."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    layout: TokenLayout
    lengths: np.ndarray
    index: np.ndarray
    """Packed-batch row of every model token, flattened as the model flattens ``[B, S]``
    (batch-major), or ``PAD``."""

    # --- the mapping model(**inputs) reads ------------------------------------------------

    def _items(self) -> dict[str, Any]:
        items: dict[str, Any] = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            items["attention_mask"] = self.attention_mask
        items["position_ids"] = self.position_ids
        items["use_cache"] = False
        return items

    def __getitem__(self, key: str) -> Any:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    # --- geometry -------------------------------------------------------------------------

    @property
    def packed(self) -> bool:
        return self.layout.packed

    @property
    def num_tokens(self) -> int:
        """Tokens every router sees (padding included)."""
        return int(self.index.size)

    def token_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[num_tokens]`` bool: True at real tokens, in the routers' token order."""
        return torch.from_numpy(self.index != PAD).to(device or self.input_ids.device)

    def pad(self, field: PackedTensor, fill: float | int = 0) -> torch.Tensor:
        """A per-token field (``loss_mask``, ``logprobs``, ...) laid out as ``input_ids``:
        ``[B, S, *row_shape]``, ``fill`` at padding."""
        self._check_lengths(field, "field")
        rows = torch.from_numpy(np.where(self.index != PAD, self.index, 0))
        values = field.values
        out = values.index_select(0, rows.to(values.device)) if values.shape[0] else None
        if out is None:
            out = values.new_zeros((self.index.size, *field.row_shape))
        pads = torch.from_numpy(self.index == PAD).to(values.device)
        out[pads] = fill
        return out.view(*self.input_ids.shape, *field.row_shape)

    def unpad(self, flat: torch.Tensor) -> PackedTensor:
        """Rows ``[num_tokens, ...]`` in the routers' order back to the batch's packed form."""
        if flat.shape[0] != self.index.size:
            raise ReplayError(
                f"expected {self.index.size} token rows (the inputs' tokens), found {flat.shape[0]}"
            )
        real = np.flatnonzero(self.index != PAD)
        order = real[np.argsort(self.index[real], kind="stable")]
        values = flat.index_select(0, torch.from_numpy(order).to(flat.device))
        return PackedTensor.from_lengths(values, self.lengths)

    def routes(
        self,
        routes: PackedTensor,
        layers: ModelLayers,
        *,
        layer_axis: Literal["all", "moe"],
        fill: Fill,
    ) -> list[torch.Tensor]:
        """One ``[num_tokens, topk]`` int32 tensor per MoE layer, in the routers' order."""
        self._check_lengths(routes, "routes")
        layout = replace(self.layout, layers=layers)
        if self.packed:
            return expand(routes, layout, fill=fill, layer_axis=layer_axis)
        per_layer = expand_batch_major(routes, layout, fill=fill, layer_axis=layer_axis)
        return [tensor.reshape(-1, tensor.shape[-1]) for tensor in per_layer]

    def _check_lengths(self, field: PackedTensor, what: str) -> None:
        if not isinstance(field, PackedTensor):
            raise ReplayError(f"{what} must be a PackedTensor, found {type(field).__name__}")
        if not np.array_equal(field.lengths, self.lengths):
            raise ReplayError(
                f"{what} must hold the inputs' samples, lengths {self.lengths.tolist()}, found "
                f"{field.lengths.tolist()}"
            )


def hf_inputs(
    batch: TensorBatch | PackedTensor,
    *,
    packed: bool = False,
    padding_side: Literal["left", "right"] = "right",
    pad_multiple: int | None = None,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    field: str = "token_ids",
) -> HFInputs:
    """Model inputs for a batch's ``token_ids`` (a ``TensorBatch`` or the packed field).

    ``packed=False``: ``[B, S]`` padded on ``padding_side`` to the longest sample (rounded up
    to ``pad_multiple``), ``attention_mask`` 1 at real tokens, positions counting real
    tokens. ``packed=True``: one ``[1, N]`` stream, positions restarting at every sample
    and no attention mask. The restarts are all that keeps the samples apart: only for a
    model whose every layer reads them, an attention layer whose mask transformers builds
    from ``position_ids`` (sdpa, eager, flex) or flash attention, as Qwen3-MoE, Mixtral,
    DeepSeek-V3 and most MoE families do. Not for GPT-OSS, AFMoE and GraniteMoE-Hybrid
    (their masks are built without ``position_ids``), nor for a model with recurrent or
    convolution layers (``layer_types`` ``linear_attention``, ``conv``, ``hybrid``...: Qwen3-Next,
    Qwen3.5-MoE, Jamba, NemotronH, LFM2-MoE, MiniMax, Kimi-Linear, ...): every sample after
    the first would attend to, or start from the state of, the ones before it. These inputs
    do not know the model; :func:`~r3data.replay.hf.replay` and
    :func:`~r3data.replay.hf.record` refuse them for such a model with a
    :class:`~r3data.errors.ReplayError` (:func:`~r3data.replay.hf_packed.check_packed` is the
    same check on its own); use the padded form for them.
    """
    tokens = batch[field] if isinstance(batch, TensorBatch) else batch
    if not isinstance(tokens, PackedTensor) or tokens.row_shape != ():
        found = getattr(tokens, "row_shape", type(tokens).__name__)
        raise ReplayError(f"{field} must be a PackedTensor of token ids [rows], found {found}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ReplayError(f"{field} must hold integer token ids, found {tokens.dtype}")
    layout = TokenLayout(packed=packed, padding_side=padding_side, pad_multiple=pad_multiple)
    lengths = tokens.lengths
    grid = layout.token_grid(lengths)
    index = (grid if packed else grid.T).reshape(-1)
    shape = (1, index.size) if packed else (lengths.size, grid.shape[0])
    real = index != PAD
    rows = torch.from_numpy(np.where(real, index, 0))
    ids = tokens.values.long().cpu()
    input_ids = ids[rows] if ids.numel() else torch.zeros(index.size, dtype=torch.long)
    input_ids[torch.from_numpy(~real)] = pad_token_id
    mask = torch.from_numpy(real).view(shape)
    if packed:
        padded = layout.padded_lengths(lengths)
        positions = torch.from_numpy(aranges(np.zeros_like(padded), padded)).view(shape)
        attention_mask = None
    else:
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        attention_mask = mask.long()
    device = torch.device("cpu") if device is None else torch.device(device)
    return HFInputs(
        input_ids=input_ids.view(shape).to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        position_ids=positions.to(device),
        layout=layout,
        lengths=lengths.copy(),
        index=index,
    )
