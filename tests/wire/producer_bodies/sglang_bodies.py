"""SGLang response bodies, per format version.

Inputs are the engine's rows: ``routes[p]`` the ``[num_hidden_layers, topk]`` row of position
``p`` for ``p`` in ``[0, prompt_len + completion_len - 1)``. SGLang keeps them in an int32
host cache indexed by KV slot, all decoder layers (dense layers are never written, so zero),
fused shared-expert columns dropped (``[:topk]``). Sources: SGLang wheels from PyPI at the
release tags; sglang/srt/state_capturer/base.py (0.5.12+) or
sglang/srt/layers/moe/routed_experts_capturer.py (0.5.7-0.5.11).

- 0.5.7: ``/generate`` ``meta_info.routed_experts``, rows from 0.
- 0.5.8-0.5.11: ``routed_experts_start_len`` accepted by the request but never used: rows
  still from 0.
- 0.5.9+: OpenAI endpoints take ``return_routed_experts``; the routes go in a
  *response-level* ``sglext.routed_experts`` (not per choice), first choice only.
- 0.5.12+: ``routed_experts_start_len`` honoured (``/generate`` and OpenAI).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .common import b64_raw, check_routes, orjson_body, sse

__all__ = ["Item", "generate_body", "generate_stream", "openai_body", "openai_stream", "rows"]


@dataclass(frozen=True)
class Item:
    """One generated sequence: prompt ids, output ids and the engine's rows."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    routes: np.ndarray | None


def _version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def rows(item: Item, start_len: int, version: str) -> np.ndarray:
    """The rows SGLang returns: ``[start, seqlen - 1)`` as int32, ``start`` clamped to
    ``seqlen - 1``.

    0.5.23 state_capturer/base.py ``BaseTopkCapturer.get_topk`` (``req_to_token[...]
    [start_len : seqlen - 1]``, ``seqlen = len(origin_input_ids) + len(output_ids)``,
    managers/scheduler_components/batch_result_processor.py ``_maybe_collect_routed_experts``).
    0.5.7-0.5.11 ``get_routed_experts`` reads ``[: seqlen - 1]``: the start is ignored.
    A start above the prompt length aborts the request (managers/scheduler.py).
    """
    routes = check_routes(item.routes)
    seqlen = len(item.prompt_ids) + len(item.output_ids)
    if routes.shape[0] != seqlen - 1:
        raise ValueError(f"engine rows: expected {seqlen - 1}, got {routes.shape[0]}")
    if not 0 <= start_len <= len(item.prompt_ids):
        raise ValueError("routed_experts_start_len must be in [0, prompt_tokens]")
    start = min(start_len, seqlen - 1) if _version(version) >= (0, 5, 12) else 0
    return np.ascontiguousarray(routes[start:].astype("<i4"))


def _meta(item: Item, start_len: int, version: str, finished: bool, index: int) -> dict:
    meta = {
        "id": f"req-{index}",
        "finish_reason": {"type": "length", "length": len(item.output_ids)} if finished else None,
        "prompt_tokens": len(item.prompt_ids),
        "weight_version": "default",
        "reasoning_tokens": 0,
        "completion_tokens": len(item.output_ids),
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if finished and item.routes is not None:
        # tokenizer_manager.py: meta_info["routed_experts"] is set only when the request has
        # routes (absent otherwise); it is base64 of the flat int32 bytes
        # (detokenizer_manager.py ``_b64_encode_per_request``: ``tensor.numpy().tobytes()``).
        meta["routed_experts"] = b64_raw(rows(item, start_len, version))
    return meta


def generate_body(
    items: Sequence[Item], *, start_len: int = 0, batched: bool = False, version: str = "0.5.23"
) -> bytes:
    """``POST /generate`` with ``"return_routed_experts": true``.

    One object ``{"text", "output_ids", "meta_info"}`` per sequence; a batched request
    (several prompts or ``n > 1``) returns a JSON list of them. ``routed_experts_start_len``
    is a request field and is not echoed in ``meta_info``. The shape is not sent: the reader
    reshapes ``(-1, num_hidden_layers, num_experts_per_tok)`` from the model config
    (state_capturer/routed_experts.py ``extract_routed_experts_from_meta_info`` decodes the
    flat int32 only).
    """
    if _version(version) < (0, 5, 7):
        raise ValueError("SGLang returns routed experts from 0.5.7 on")
    objs = [
        {
            "text": "".join(f"<{t}>" for t in item.output_ids),
            "output_ids": list(item.output_ids),
            "meta_info": _meta(item, start_len, version, True, index),
        }
        for index, item in enumerate(items)
    ]
    if not batched and len(objs) != 1:
        raise ValueError("a single request has one item; pass batched=True")
    return orjson_body(objs if batched else objs[0])


def generate_stream(
    item: Item, *, start_len: int = 0, tokens_per_chunk: int = 2, version: str = "0.5.23"
) -> bytes:
    """``POST /generate`` with ``"stream": true``: ``meta_info.routed_experts`` appears only in
    the final chunk (rows are gathered when the request finishes,
    ``_maybe_collect_routed_experts``), covering the whole request; earlier chunks have none.
    """
    events = []
    ids = list(item.output_ids)
    for at in range(tokens_per_chunk, len(ids) + tokens_per_chunk, tokens_per_chunk):
        done = at >= len(ids)
        events.append(
            orjson_body(
                {
                    "text": "".join(f"<{t}>" for t in ids[:at]),
                    "output_ids": ids[:at],
                    "meta_info": _meta(item, start_len, version, done, 0),
                }
            )
        )
    return sse(events)


def openai_body(
    items: Sequence[Item],
    *,
    chat: bool,
    start_len: int = 0,
    version: str = "0.5.23",
) -> bytes:
    """``/v1/chat/completions`` or ``/v1/completions`` with ``"return_routed_experts": true``.

    entrypoints/openai/protocol.py: ``SglExt`` is a field of ``ChatCompletionResponse`` and
    ``CompletionResponse`` (the response, after ``metadata``), not of the choices; it drops its
    null fields and the response drops a null ``sglext``. serving_chat.py /
    serving_completions.py build it from ``ret[0]`` only ("from first ret_item"): with
    ``n > 1`` or several prompts only the first sequence's routes are sent. With
    ``return_meta_info`` (chat, 0.5.20+) ``sglext.routed_experts`` is left out.
    """
    if _version(version) < (0, 5, 9):
        raise ValueError("SGLang's OpenAI endpoints return routed experts from 0.5.9 on")
    first = items[0]
    routed = b64_raw(rows(first, start_len, version)) if first.routes is not None else None
    choices = []
    for index, item in enumerate(items):
        text = "".join(f"<{t}>" for t in item.output_ids)
        if chat:
            choices.append(
                {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "reasoning_content": None,
                        "tool_calls": None,
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                    "matched_stop": None,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "matched_stop": None,
                }
            )
    prompt_tokens = len(first.prompt_ids)
    completion_tokens = sum(len(item.output_ids) for item in items)
    body = {
        "id": "sgl-r3data",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1_760_000_000,
        "model": "tiny-moe",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        },
        "metadata": {"weight_version": "default"},
    }
    if routed is not None:
        body["sglext"] = {"routed_experts": routed}
    return orjson_body(body)


def _chat_chunk(choices: list[dict], **extra: object) -> bytes:
    return orjson_body(
        {
            "id": "sgl-r3data",
            "object": "chat.completion.chunk",
            "created": 1_760_000_000,
            "model": "tiny-moe",
            "choices": choices,
            "usage": None,
            **extra,
        }
    )


def openai_stream(item: Item, *, start_len: int = 0, version: str = "0.5.23") -> bytes:
    """Chat streaming with ``return_routed_experts``: content chunks carry no routes; after the
    last content chunk one extra chunk with ``"choices": []`` and ``sglext.routed_experts``
    (the first non-null routes of any choice) is sent (serving_chat.py
    ``_generate_chat_stream``, "routed_experts_chunk")."""
    events = [
        _chat_chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": f"<{token}>"},
                    "logprobs": None,
                    "finish_reason": None,
                    "matched_stop": None,
                }
            ]
        )
        for token in item.output_ids
    ]
    if item.routes is not None:
        routed = b64_raw(rows(item, start_len, version))
        events.append(_chat_chunk([], sglext={"routed_experts": routed}))
    return sse(events)
