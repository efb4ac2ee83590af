"""Tiny random transformers MoE models (built from configs, no downloads) and batches for them."""

from __future__ import annotations

import warnings

import numpy as np
import torch

import r3data
from r3data import PackedTensor, TensorBatch
from r3data.wire import InlineRows, pack_ndarray

VOCAB, EXPERTS, TOPK = 96, 8, 2
LENGTHS = (5, 9, 3)

#: Set on every config that has the field: 2 layers, hidden 32, 8 experts, top-2.
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOPK,
    "moe_topk": TOPK,
    "top_k_experts": TOPK,
    "max_position_embeddings": 128,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "shared_expert_intermediate_size": 16,
    "n_shared_experts": 1,
    "expert_intermediate_size": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
}

#: Family fields the common ones do not reach (layer patterns, nested configs, MLA sizes).
EXTRA: dict[str, dict] = {
    "bailing_hybrid": {
        "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["linear_attention", "full_attention"],
    },
    "beam": {
        "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
    },
    "dbrx": {
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": EXPERTS, "moe_top_k": TOPK},
    },
    "dots3_note_text": {
        "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["sliding_attention", "sliding_attention"],
        "index_head_dim": 8,
        "index_n_heads": 2,
        "index_topk": 4,
    },
    "flint": {"mlp_only_layers": [0], "layer_types": ["full_attention", "sliding_attention"]},
    "gemma4_text": {
        "enable_moe_block": True,
        "moe_intermediate_size": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
        "global_head_dim": 8,
    },
    "glm5_next_text": {
        "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["linear_attention", "indexed_attention"],
        "index_head_dim": 8,
        "index_n_heads": 2,
        "index_topk": 16,
        "indexer_types": ["full", "full"],
        "qk_rope_head_dim": 0,
        "head_dim": 0,
        "qk_head_dim": 8,
    },
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "longcat_flash": {
        "num_layers": 2,
        "zero_expert_num": 2,
        "expert_ffn_hidden_size": 16,
        "ffn_hidden_size": 32,
    },
    "mistral4": {"head_dim": 16, "qk_head_dim": 16},
    # gated delta-net layers run a slow reference kernel on the CPU; the router is the same
    "qwen3_next": {"layer_types": ["full_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["full_attention", "full_attention"]},
    "qwen4_exp_text": {
        "layer_types": ["indexed_attention", "indexed_attention"],
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
    },
    "lara_mini": {"layer_types": ["full_attention", "sliding_attention"]},
    "zaya": {"num_experts_per_tok": 1},
}

#: Families replayed end to end: the model type built and whether it is a causal LM (else
#: the text decoder of a vision-language family, compared on its last hidden states).
FAMILIES: dict[str, tuple[str, bool]] = {
    name: (name, True)
    for name in [
        "afmoe",
        "axk1",
        "axk2",
        "bailing_hybrid",
        "beam",
        "cohere2_moe",
        "dbrx",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "dots1",
        "ernie4_5_moe",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "gpt_oss",
        "granitemoe",
        "granitemoe_swa",
        "granitemoehybrid",
        "granitemoeshared",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "jamba",
        "kimi_linear",
        "kolibri1",
        "laguna",
        "lara_mini",
        "lfm2_moe",
        "longcat_flash",
        "mellum",
        "mimo_v2_flash",
        "minimax",
        "minimax_m2",
        "mixtral",
        "nemotron_h",
        "olmoe",
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "solar_open",
    ]
} | {
    "aria": ("aria_text", True),
    "dots3_note": ("dots3_note_text", True),
    "gemma4": ("gemma4_text", True),
    "inkling": ("inkling_text", True),
    "inkling2": ("inkling2_text", True),
    "inkling2_loop": ("inkling2_loop_text", True),
    "llama4": ("llama4_text", True),
    "minimax_m3_vl": ("minimax_m3_vl_text", True),
    "qwen3_5_moe": ("qwen3_5_moe_text", True),
    "qwen4_exp": ("qwen4_exp_text", True),
    "glm5_next": ("glm5_next_text", False),
    "mistral4": ("mistral4", False),
    "mistral_large4": ("mistral_large4_text", False),
    "muse_spark": ("muse_spark_text", False),
    "qwen3_vl_moe": ("qwen3_vl_moe_text", False),
}

#: Families refused before any forward, and a phrase of why.
REFUSED: dict[str, str] = {
    "jetmoe": "2 routers",
    "phimoe": "without a top-k",
    "zaya": "without a top-k",
    "deepseek_v4": "without a top-k",
    "doge": "found no list",
}


def tiny_config(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = config_class().to_dict()
        aliases = getattr(config_class, "attribute_map", {})
        fields = {aliases.get(k, k): v for k, v in COMMON.items() if aliases.get(k, k) in defaults}
        if "qk_rope_head_dim" in defaults:
            fields["num_key_value_heads"] = fields["num_attention_heads"]  # MLA: one per head
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(defaults.get(name), int) and defaults[name] >= VOCAB:
                fields[name] = 1
        fields.update(EXTRA.get(model_type, {}))
        fields.update({aliases.get(k, k): v for k, v in overrides.items()})
        return config_class(**fields)


def tiny_model(family: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, bool]:
    """A random model of ``family`` (weights drawn wide enough that routing is not flat),
    its config fields ``overrides`` set over the tiny ones."""
    from transformers import AutoModel, AutoModelForCausalLM

    model_type, causal = FAMILIES.get(family, (family, True))
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder = AutoModelForCausalLM if causal else AutoModel
        model = builder.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    return model, causal


def outputs(model: torch.nn.Module, causal: bool, inputs) -> torch.Tensor:
    """Logits (causal LMs) or last hidden states (text decoders), ``[B, S, ...]``."""
    result = model(**inputs)
    return result.logits if causal else result.last_hidden_state


def token_batch(lengths=LENGTHS, seed: int = 0) -> TensorBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, VOCAB, (n,), generator=generator) for n in lengths]
    return TensorBatch({"token_ids": PackedTensor.from_segments(tokens)})


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every router module (the modules whose parameters make the router logits)."""
    from r3data.replay.hf_routers import find_routers

    found = []
    for site in find_routers(model).sites:
        router = getattr(site.module, "router", None) if site.method != "forward" else None
        found.append(router or site.module)
    return found


def samples(batch: TensorBatch, routes: PackedTensor, source: str) -> list[dict]:
    """Loader samples of the batch's tokens with ``routes`` as a producer sent them.

    ``"prime-rl"``: an inline envelope without the last token's row (the engine never
    forwards it; the loader repeats the previous row there). ``"inline"``: every row, the
    last one included (``last_token_row=True`` in the loader's trace options).
    """
    out = []
    for i, (tokens, rows) in enumerate(zip(batch["token_ids"], routes, strict=True)):
        rows = rows.numpy()
        if source == "prime-rl":
            response = {"choices": [{"routed_experts": pack_ndarray(rows[:-1])}]}
            sources = [{"producer": "prime-rl", "response": response}]
        else:
            sources = [InlineRows("routed_experts", np.ascontiguousarray(rows), 0)]
        prompt = max(1, len(tokens) // 2)
        request = {"prompt_len": prompt, "completion_len": len(tokens) - prompt, "sources": sources}
        out.append({"id": f"s{i}", "token_ids": tokens.numpy(), "requests": [request]})
    return out


def load(samples_: list[dict], *, last_token_row: bool = False) -> TensorBatch:
    """The one batch ``r3data.loader`` makes of ``samples_``."""
    trace = {"last_token_row": last_token_row}
    (batch,) = list(
        r3data.loader(samples_, batch_size=len(samples_), collate={"workers": 1}, trace=trace)
    )
    return batch
