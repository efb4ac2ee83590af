"""A tiny randomly initialised Qwen3-MoE checkpoint for the real-server tests, and its routing
as transformers computes it.

The checkpoint (weights, config, a word-level tokenizer with a chat template) is built here
with transformers, from a fixed seed, without any model hub: the machines have no internet.
It is cached under a folder named by a hash of :data:`RECIPE`, so a run builds it once and
later runs reuse it; change the recipe (or :data:`BUILD_VERSION`, when the build code
changes) and a new one is built beside the old.

Layer 1 is dense (``mlp_only_layers``): vLLM reports it as all-zero route rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BUILD_VERSION = 1
"""Bump when :func:`build` changes what it writes for the same recipe."""

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
WORDS = (
    *ROLES,
    *("the", "a", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "route", "expert", "token", "layer", "router", "replay", "trainer", "server"),
    *("model", "batch", "red", "green", "blue", "fox", "dog", "cat", "bird", "fish", "tree"),
    *("river", "hill", "stone", "hello", "world", "please", "tell", "me", "about", "how"),
    *("why", "what", "when", "where"),
)
VOCAB_SIZE = 256
FILLERS = tuple(f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(WORDS)))
PLAIN_WORDS = WORDS + FILLERS
"""Every token that decodes to itself and re-encodes to the same id (no specials)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message.role }} {{ message.content }} "
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
)

MOE_LAYERS = (0, 2)
DENSE_LAYERS = (1,)

RECIPE: dict[str, Any] = {
    "build_version": BUILD_VERSION,
    "seed": 0,
    # Router weights far larger than the default init: routing then differs clearly between
    # tokens, and no top-k choice sits on a near tie that float rounding could flip.
    "router_std": 1.0,
    "vocab": [*SPECIAL_TOKENS, *PLAIN_WORDS],
    "chat_template": CHAT_TEMPLATE,
    "config": {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": len(MOE_LAYERS) + len(DENSE_LAYERS),
        "mlp_only_layers": list(DENSE_LAYERS),
        "decoder_sparse_step": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
}
NUM_LAYERS: int = RECIPE["config"]["num_hidden_layers"]
NUM_EXPERTS: int = RECIPE["config"]["num_experts"]
TOPK: int = RECIPE["config"]["num_experts_per_tok"]


def recipe_key() -> str:
    """A short hash naming the checkpoint :data:`RECIPE` describes."""
    text = json.dumps(RECIPE, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_checkpoint(cache_root: Path) -> Path:
    """The checkpoint folder under ``cache_root``, built first when missing.

    The build goes to a temporary folder renamed into place once complete, so an interrupted
    build never leaves a half-written checkpoint under the final name.
    """
    final = cache_root / f"tiny-moe-{recipe_key()}"
    if (final / "config.json").is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".tiny-moe-", dir=cache_root))
    try:
        build(partial)
        os.rename(partial, final)
    except OSError:
        if not (final / "config.json").is_file():  # not a concurrent build that won
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def build(out: Path) -> None:
    """Write the tokenizer and the randomly initialised model of :data:`RECIPE` to ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = {token: i for i, token in enumerate(RECIPE["vocab"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with single spaces
    words.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tokenizer.chat_template = RECIPE["chat_template"]
    tokenizer.save_pretrained(out)

    config = Qwen3MoeConfig(
        **RECIPE["config"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        dtype="float32",
    )
    torch.manual_seed(RECIPE["seed"])
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for index in MOE_LAYERS:
            model.model.layers[index].mlp.gate.weight.normal_(0.0, RECIPE["router_std"])
    model.save_pretrained(out)


def load_model(checkpoint: Path) -> Any:
    """The checkpoint as a transformers model in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def router_topk(model: Any, token_ids: list[int]) -> np.ndarray:
    """``[len(token_ids), NUM_LAYERS, TOPK]``: the experts each layer's router picks for each
    token, in the router's own order, read from its output; dense layers all zero, as vLLM
    reports them."""
    import torch

    picked: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if router is None:
            continue  # a dense MLP

        def keep(_module: Any, _args: Any, output: Any, index: int = index) -> None:
            picked[index] = output[2]  # (router_logits, top-k weights, top-k indices)

        hooks.append(router.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    if tuple(sorted(picked)) != MOE_LAYERS:
        raise AssertionError(f"routers seen in layers {sorted(picked)}, expected {MOE_LAYERS}")
    routes = np.zeros((len(token_ids), NUM_LAYERS, TOPK), np.int64)
    for index, indices in picked.items():
        routes[:, index] = indices.reshape(len(token_ids), TOPK).numpy()
    return routes
