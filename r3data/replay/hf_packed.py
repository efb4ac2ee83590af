"""Which Hugging Face models keep the samples of the packed input form apart.

The packed form (``hf_inputs(packed=True)``) separates samples only by the restarts of
``position_ids``; a model whose masks or layers do not read them would mix the samples
silently, so :func:`check_packed` refuses such inputs before the forward.
"""

from __future__ import annotations

import torch

from r3data.errors import ReplayError
from r3data.replay.hf_inputs import HFInputs

__all__ = ["check_packed"]

#: Families whose decoder builds its attention masks without ``position_ids`` (transformers
#: 5.24: ``GptOssModel``, ``AfmoeModel``, ``GraniteMoeHybridModel`` leave them out of
#: ``mask_kwargs``), so the packed form's position restarts never reach the mask: a plain
#: causal mask over the whole stream.
_MASK_WITHOUT_POSITIONS = frozenset({"gpt_oss", "afmoe", "granitemoehybrid"})
#: Layer kinds (transformers' ``layer_types`` names, ``"mamba"`` as older configs call
#: ``"linear_attention"``) that carry a recurrent or convolution state along the sequence:
#: Mamba, gated delta-net, lightning and KDA linear attention, short convolutions, and
#: layers combining one of them with attention. None of them reads ``position_ids``.
_STATEFUL_LAYERS = frozenset({"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding"})
#: Families with such layers, for a config that lists no layer kinds (``layer_types``).
_STATEFUL_FAMILIES = frozenset(
    {
        "bailing_hybrid",
        "glm5_next_text",
        "granitemoehybrid",
        "inkling_text",
        "inkling2_text",
        "inkling2_loop_text",
        "jamba",
        "kimi_linear",
        "lfm2_moe",
        "minimax",
        "nemotron_h",
        "qwen3_5_moe_text",
        "qwen3_next",
        "zaya",
    }
)


def check_packed(model: torch.nn.Module, inputs: HFInputs) -> None:
    """Refuse packed inputs (``hf_inputs(packed=True)``) for a transformers model that would
    not keep their samples apart.

    The packed form separates samples only by the restarts of ``position_ids``. transformers
    reads them where the model hands ``position_ids`` to its mask builders (sdpa, eager,
    flex: a block-diagonal causal mask) or to flash attention. A model whose decoder builds
    its masks without them (:data:`_MASK_WITHOUT_POSITIONS`), or one with layers that carry
    a state along the sequence (:data:`_STATEFUL_LAYERS`, read from the text config's
    ``layer_types``), lets every sample after the first attend to, or start from the state
    of, the samples before it: wrong logits and gradients, silently. Padded inputs and
    models without a transformers config (torchtitan's) pass.
    """
    if not getattr(inputs, "packed", False):
        return
    config = getattr(model, "config", None)
    if config is None:
        return
    getter = getattr(config, "get_text_config", None)
    text = getter(decoder=True) if getter is not None else config
    types = {str(getattr(c, "model_type", "") or "") for c in (config, text)} - {""}
    name = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    what = f"{type(model).__name__} (model type {name!r})"
    kinds = _layer_kinds(text)
    stateful = [kind for kind in dict.fromkeys(kinds) if kind in _STATEFUL_LAYERS]
    if types & _MASK_WITHOUT_POSITIONS:
        why = (
            "its decoder builds the attention mask without position_ids, so the packed form's "
            "position restarts never reach it and every sample attends to the samples before it"
        )
    elif stateful:
        layers = [i for i, kind in enumerate(kinds) if kind in _STATEFUL_LAYERS]
        why = (
            f"its {'/'.join(stateful)} layers ({_spans(layers)} of {len(kinds)}) carry a "
            "recurrent or convolution state along the sequence and do not read position_ids, "
            "so every sample starts from the state the samples before it left"
        )
    elif not kinds and types & _STATEFUL_FAMILIES:
        why = (
            "its family has recurrent or convolution layers, which do not read position_ids, "
            "so every sample starts from the state the samples before it left"
        )
    else:
        return
    raise ReplayError(
        f"packed inputs (hf_inputs(packed=True)) would mix the samples in {what}: {why}, "
        "giving wrong log-probabilities and gradients; use the padded form, hf_inputs(batch) "
        "(packed=False)"
    )


def _layer_kinds(config) -> list[str]:
    for attr in ("layer_types", "layers_block_type"):
        kinds = getattr(config, attr, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [str(kind) for kind in kinds]
    return []


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"layer{'s' if len(indices) > 1 else ''} {text}"
