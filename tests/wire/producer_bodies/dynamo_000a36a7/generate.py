"""Write response bodies the way NVIDIA Dynamo's vLLM worker and OpenAI frontend build them
(github ai-dynamo/dynamo main at 000a36a7399a; the envelope as of PR #10529):

- the worker (components/src/dynamo/vllm/response_adapters.py
  ``serialize_legacy_routed_experts``, ``LegacyResponseAdapter.adapt``; handlers.py
  ``_serialize_routed_experts`` before the split): on the chunk that finishes an output
  index, ``engine_data.routed_experts = {"data": base64 of ndarray.tobytes(), "shape":
  [int(d) for d in shape], "start": min(routed_experts_prompt_start, prompt length),
  "dtype": str(ndarray.dtype)}``; one chunk per output index and engine step;
- the frontend (lib/llm/src/protocols/openai/nvext.rs ``build_response_nvext``: with
  ``"routed_experts"`` in the request's ``nvext.extra_fields`` the chunk's ``nvext`` gets
  ``engine_data["routed_experts"]`` as is, with ``"engine_data"`` the whole engine_data;
  chat_completions/delta.rs and completions/delta.rs put ``nvext`` on the chunk, after the
  flattened OpenAI fields (``NvCreateChatCompletionStreamResponse``); the non-stream
  aggregators fold the chunks, ``merge_response_nvext`` key by key, the last writer winning);
- serde_json: compact, non-ASCII as UTF-8; a ``serde_json::Value`` map iterates its keys
  sorted (the workspace's serde_json has no ``preserve_order``, lib Cargo.toml at
  0230a315ea6a), so the nvext keys and the envelope's come out sorted; one case keeps the
  worker's insertion order, as ``preserve_order`` would.

Run with any numpy (no Dynamo needed: its serializers are reproduced here):

    /work/main/.venv/bin/python tests/wire/producer_bodies/dynamo_000a36a7/generate.py \
        tests/wire/producer_bodies/dynamo_000a36a7

It writes ``<case>.body`` and ``expected.json`` (per choice: prompt and completion lengths,
start, rows, dtype; ``refused`` for a body no decoder may read), which
tests/wire/test_wire_producers_dynamo.py reads.
"""

import base64
import json
import sys
from pathlib import Path

import numpy as np

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
cases: dict[str, dict] = {}


def serde(value) -> bytes:
    """``serde_json::to_vec`` of a value (compact; ``Value`` maps were sorted on the way)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def value(obj, *, preserve_order: bool = False):
    """A Python object as it comes out of a ``serde_json::Value``: maps sorted by key, unless
    the build has ``preserve_order``."""
    if isinstance(obj, dict):
        items = obj.items() if preserve_order else sorted(obj.items())
        return {k: value(v, preserve_order=preserve_order) for k, v in items}
    if isinstance(obj, list):
        return [value(v, preserve_order=preserve_order) for v in obj]
    return obj


def worker_envelope(routed: np.ndarray, start: int, prompt_len: int) -> dict:
    """The vLLM worker's routes, as it serialises vLLM's ndarray on the finishing chunk."""
    return {
        "data": base64.b64encode(routed.tobytes()).decode("ascii"),
        "shape": [int(d) for d in routed.shape],
        "start": int(min(start, prompt_len)),
        "dtype": str(routed.dtype),
    }


def engine_routes(P: int, C: int, start: int, experts: int, dtype) -> np.ndarray:
    """vLLM's ``routed_experts`` for a request: rows ``[start, P + C - 1)``, 4 layers x top-2,
    layer 0 dense (zero), in vLLM's output dtype."""
    rows = rng.integers(0, experts, (P + C - 1 - start, 4, 2)).astype(dtype)
    rows[:, 0] = 0
    return rows


def nvext(engine_data: dict, extra_fields: list[str], completion_ids: list[int] | None) -> dict:
    """``build_response_nvext`` of one chunk, as a Value (None fields skipped)."""
    out = {}
    if "routed_experts" in extra_fields and "routed_experts" in engine_data:
        out["routed_experts"] = engine_data["routed_experts"]
    if "engine_data" in extra_fields and engine_data:
        out["engine_data"] = engine_data
    if "completion_token_ids" in extra_fields and completion_ids is not None:
        out["completion_token_ids"] = completion_ids
    return out


def usage(P: int, C: int) -> dict:
    return {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C}


def worker_chunks(samples: list[dict], P: int, per_chunk: int) -> list[dict]:
    """The worker's chunks: each output index streams ``per_chunk`` tokens at a time, in turn
    (the order engine steps deliver them); the finishing one carries engine_data."""
    chunks, cursors = [], [0] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: samples[i].get("finishes_at", i))
    while any(cursors[i] < len(samples[i]["ids"]) for i in order):
        for i in order:
            s = samples[i]
            if cursors[i] >= len(s["ids"]):
                continue
            ids = s["ids"][cursors[i] : cursors[i] + per_chunk]
            cursors[i] += len(ids)
            chunk = {"index": i, "token_ids": ids}
            if cursors[i] == len(s["ids"]):
                chunk["finish_reason"] = "length"
                chunk["engine_data"] = {
                    "routed_experts": worker_envelope(s["routes"], s["start"], P)
                }
            chunks.append(chunk)
    return chunks


def stream_chunk(chunk: dict, *, chat: bool, extra_fields: list[str], order: bool) -> dict:
    """The frontend's stream response for one worker chunk (delta generator)."""
    finish = chunk.get("finish_reason")
    if chat:
        choice = {"index": chunk["index"], "delta": {"content": "x", "role": "assistant"},
                  "finish_reason": finish, "logprobs": None}  # fmt: skip
    else:
        choice = {"text": "x", "index": chunk["index"], "logprobs": None, "finish_reason": finish}
    body = {
        "id": "chatcmpl-7" if chat else "cmpl-7",
        "choices": [choice],
        "created": 1764633600,
        "model": "Qwen/Qwen3-30B-A3B",
        "object": "chat.completion.chunk" if chat else "text_completion",
    }
    ext = nvext(chunk.get("engine_data") or {}, extra_fields, chunk["token_ids"])
    if ext:
        body["nvext"] = value(ext, preserve_order=order)
    return body


def aggregate(chunks: list[dict], samples, P: int, *, chat: bool, order: bool) -> dict:
    """The non-stream aggregator: choices by index, nvext merged key by key (last wins,
    completion_token_ids concatenated), usage of the request."""
    merged: dict = {}
    for chunk in chunks:
        for key, val in (chunk.get("nvext") or {}).items():
            if key == "completion_token_ids":
                merged.setdefault(key, []).extend(val)
            else:
                merged[key] = val
    choices = []
    for i in range(len(samples)):
        if chat:
            choices.append({"index": i, "message": {"content": "x", "role": "assistant"},
                            "finish_reason": "length", "logprobs": None})  # fmt: skip
        else:
            choices.append({"text": "x", "index": i, "logprobs": None, "finish_reason": "length"})
    body = {
        "id": "chatcmpl-7" if chat else "cmpl-7",
        "choices": choices,
        "created": 1764633600,
        "model": "Qwen/Qwen3-30B-A3B",
        "object": "chat.completion" if chat else "text_completion",
        "usage": usage(P, sum(len(s["ids"]) for s in samples)),
    }
    if merged:
        body["nvext"] = value(merged, preserve_order=order)
    return body


def case(name, *, P, samples, extra_fields, chat=True, stream=False, order=False, refused=None):
    chunks = [
        stream_chunk(c, chat=chat, extra_fields=extra_fields, order=order)
        for c in worker_chunks(samples, P, per_chunk=2)
    ]
    if stream:
        tail = {"id": "chatcmpl-7", "choices": [], "created": 1764633600,
                "model": "Qwen/Qwen3-30B-A3B", "object": "chat.completion.chunk",
                "usage": usage(P, sum(len(s["ids"]) for s in samples))}  # fmt: skip
        events = [*chunks, tail]
        body = b"".join(b"data: " + serde(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    else:
        body = serde(aggregate(chunks, samples, P, chat=chat, order=order))
    (out / f"{name}.body").write_bytes(body)
    cases[name] = {
        "refused": refused,
        "choices": [
            {
                "P": P,
                "C": len(s["ids"]),
                "start": min(s["start"], P),
                "dtype": str(s["routes"].dtype),
                "rows": s["routes"].tolist(),
            }
            for s in samples
        ],
    }


def sample(P, C, start, experts=8, dtype=np.uint8, **extra):
    return {"ids": list(range(100, 100 + C)), "start": start,
            "routes": engine_routes(P, C, min(start, P), experts, dtype), **extra}  # fmt: skip


case("chat_uint8", P=5, samples=[sample(5, 4, 0)], extra_fields=["routed_experts"])
case(
    "chat_start_uint16_ids",
    P=6,
    samples=[sample(6, 3, 4, experts=300, dtype=np.uint16)],
    extra_fields=["routed_experts", "completion_token_ids"],
)
case(
    "completions_engine_data_int32_ordered",
    P=4,
    samples=[sample(4, 3, 1, dtype=np.int32)],
    extra_fields=["engine_data"],
    chat=False,
    order=True,
)
case("chat_zero_rows", P=4, samples=[sample(4, 1, 9)], extra_fields=["routed_experts"])
case(
    "chat_stream_n2",
    P=5,
    samples=[sample(5, 3, 2, finishes_at=1), sample(5, 5, 2, finishes_at=0)],
    extra_fields=["routed_experts"],
    stream=True,
)
case(
    "chat_n2_merged",
    P=5,
    samples=[sample(5, 3, 0), sample(5, 2, 0)],
    extra_fields=["routed_experts"],
    refused="expected a response of one choice",
)
(out / "expected.json").write_text(json.dumps(cases, indent=1) + "\n")
