"""SkyRL ``POST /skyrl/v1/generate`` bodies (NovaSky-AI/SkyRL).

SkyRL runs vLLM (0.26.0, pyproject.toml at a9564572e) behind its own endpoint
(skyrl/backends/skyrl_train/inference_servers/vllm_server_actor.py ``_skyrl_generate``),
serialised with ``orjson.dumps``; one choice, from ``final_res.outputs[0]`` (``n > 1`` is
not served). The rows are vLLM's ``output.routed_experts``: ``[start, prompt + completion
- 1)``, all decoder layers, ``start`` the request's
``sampling_params.routed_experts_prompt_start``; SkyRL does not echo it.

- v1 (7f5eba15f, 2026-04-08 .. 42f3d44b3): ``routed_experts`` as nested JSON lists
  (``resp.routed_experts.tolist()``).
- v2 (42f3d44b3, 2026-08-03, main): an envelope ``{"data", "shape", "dtype"}``
  (generate_wire.py ``pack_routed_experts``); no ``start``.
- PR #2085/#2086 (790b4b071, 2026-08-22, not merged): the same envelope through a generic
  ``pack_ndarray`` (keys ``data``, ``shape``, ``dtype``, then sidecar), plus
  ``rollout_sample_support``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .common import b64_raw, check_routes, orjson_body

__all__ = ["compact_dtype", "envelope", "generate_body", "sample_support"]


def compact_dtype(rows: np.ndarray) -> np.dtype:
    """uint8 when every id < 2**8, int16 when < 2**15, else int32, from the ids present
    (skyrl/backends/skyrl_train/utils/routed_experts.py ``compact_routed_expert_indices``).
    The reader rejects an envelope whose dtype is not this canonical one
    (generate_wire.py ``decode_packed_routed_experts``: "non-canonical dtype")."""
    top = int(rows.max(initial=0))
    if top < 2**8:
        return np.dtype(np.uint8)
    if top < 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def envelope(array: np.ndarray, dtype: np.dtype) -> dict:
    """``pack_ndarray``/``pack_routed_experts``: ``data`` first, then ``shape``, ``dtype``."""
    array = np.ascontiguousarray(array.astype(dtype))
    return {"data": b64_raw(array), "shape": list(array.shape), "dtype": array.dtype.name}


def sample_support(kept: Sequence[Sequence[int]], top_k: int) -> np.ndarray:
    """``rollout_sample_support`` rows (PR 790b4b071 vllm_server_actor.py
    ``_sample_support_from_flat_logprobs``; utils/sample_support.py): int32
    ``[completion_tokens, top_k]``, each row the kept (finite-logprob) candidates of vLLM's
    top-``top_k`` in rank order, then trailing -1. Row ``i`` is completion token ``i`` (at
    position ``prompt_len + i``; the trainer reads it at logits position ``prompt_len - 1 +
    i``). The request must set ``return_sample_support`` and ``sampling_params.top_k > 1``.
    """
    out = np.full((len(kept), top_k), -1, dtype=np.int32)
    for row, ids in enumerate(kept):
        out[row, : len(ids)] = ids
    return out


def generate_body(
    token_ids: Sequence[int],
    rows: np.ndarray | None,
    *,
    version: int = 2,
    support: np.ndarray | None = None,
) -> bytes:
    """The ``/skyrl/v1/generate`` body: ``{"choices": [{"token_ids", "finish_reason",
    "logprobs", "routed_experts"[, "rollout_sample_support"]}]}``.

    ``rows`` are vLLM's routes (already from the request's prompt start); ``None`` gives a
    null ``routed_experts``. ``version`` 1 writes nested lists, 2 the envelope; ``support``
    (PR #2085) adds ``rollout_sample_support`` as an int32 envelope.
    """
    routed = None
    if rows is not None:
        rows = check_routes(rows)
        routed = rows.tolist() if version == 1 else envelope(rows, compact_dtype(rows))
    choice = {
        "token_ids": list(token_ids),
        "finish_reason": "length",
        "logprobs": None,
        "routed_experts": routed,
    }
    if support is not None:
        choice["rollout_sample_support"] = envelope(support, np.dtype(np.int32))
    return orjson_body({"choices": [choice]})
