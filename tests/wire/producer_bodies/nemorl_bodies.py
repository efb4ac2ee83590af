"""NeMo-RL routed-expert bodies (NVIDIA-NeMo/RL at 7ea279abf, 2026-08-22, on vLLM 0.25.1).

NeMo-RL's OpenAI-compatible chat path (nemo_rl/models/generation/vllm/utils.py
``attach_routed_experts_to_chat_response_choices``) puts a *string* in each choice's
message: ``choices[i].message.routed_experts = "nrlre1:<dtype>:<S>x<L>x<K>:<base64>"``
(nemo_rl/utils/routed_experts_codec.py ``encode_routed_experts``; the reader also accepts
the legacy nested lists). ``S`` is the whole sequence, ``prompt + completion`` rows:
``pad_and_align_routed_expert_indices`` copies vLLM's rows into rows ``[0, expected)``
(``expected = prompt + completion - 1``), fills missing rows with -1 (all ``topk`` slots:
"no route", the trainer's router decides those tokens) and leaves the last row, which no
forward produced, as ``arange(topk)``. ``L`` is vLLM's layer axis (all decoder layers on
0.25.1, though NeMo-RL's messages call it ``num_moe_layers``).
"""

from __future__ import annotations

import numpy as np

from .common import b64_raw, check_routes, starlette_body

__all__ = ["aligned_rows", "carry_dtype", "chat_body", "envelope_string"]


def carry_dtype(num_experts: int | None) -> np.dtype:
    """int8 when ``num_experts - 1 <= 127``, int16 when ``<= 32767``, else int32; int16 when
    the expert count is unknown (nemo_rl/models/generation/interfaces.py
    ``resolve_routed_experts_dtype``): signed, so -1 fits. By the model, not the ids."""
    if num_experts is None:
        return np.dtype(np.int16)
    if num_experts - 1 <= 127:
        return np.dtype(np.int8)
    if num_experts - 1 <= 32767:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def aligned_rows(
    engine_rows: np.ndarray, prompt_len: int, completion_len: int, num_experts: int | None
) -> np.ndarray:
    """``pad_and_align_routed_expert_indices`` with ``valid_length = padded_length =
    prompt + completion``: ``[S, L, K]`` where rows past what vLLM returned are -1 and the
    final row is ``arange(K)``. ``engine_rows`` are vLLM's rows from position 0 (NeMo-RL
    sends no prompt start); fewer rows than ``S - 1`` model the missing-route case."""
    engine_rows = check_routes(engine_rows)
    length = prompt_len + completion_len
    expected = max(length - 1, 0)
    layers, topk = engine_rows.shape[1:]
    dtype = carry_dtype(num_experts)
    full = np.broadcast_to(np.arange(topk, dtype=dtype), (length, layers, topk)).copy()
    copied = min(expected, engine_rows.shape[0])
    full[:copied] = engine_rows[:copied]
    full[copied:expected] = -1
    return full


def envelope_string(rows: np.ndarray) -> str:
    """``encode_routed_experts``: ``"nrlre1:" + dtype + ":" + "SxLxK" + ":" + base64``."""
    rows = np.ascontiguousarray(rows)
    name = {np.dtype(np.int8): "int8", np.dtype(np.int16): "int16", np.dtype(np.int32): "int32"}
    tokens, layers, topk = rows.shape
    return f"nrlre1:{name[rows.dtype]}:{tokens}x{layers}x{topk}:{b64_raw(rows)}"


def chat_body(
    rows: np.ndarray,
    completion_ids: list[int],
    *,
    legacy_lists: bool = False,
    prompt_ids: list[int] | None = None,
) -> bytes:
    """A vLLM chat response as NeMo-RL returns it, with ``message.routed_experts`` set; with
    ``prompt_ids``, the token information NeMo-RL attaches to the message too
    (``attach_token_information_to_chat_response_choices``)."""
    value = rows.tolist() if legacy_lists else envelope_string(rows)
    body = {
        "id": "chatcmpl-nemo",
        "object": "chat.completion",
        "created": 1_760_000_000,
        "model": "tiny-moe",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(f"<{t}>" for t in completion_ids),
                    "routed_experts": value,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": completion_ids,
            }
        ],
    }
    if prompt_ids is not None:
        body["choices"][0]["message"].update(
            prompt_token_ids=prompt_ids,
            generation_token_ids=completion_ids,
            generation_log_probs=[-0.5] * len(completion_ids),
        )
    return starlette_body(body)
