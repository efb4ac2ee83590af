"""Write response bodies with SGLang 0.5.23's own serializer: its OpenAI pydantic models
(srt/entrypoints/openai/protocol.py) dumped with ``model_dump_json(by_alias=True)``
(utils/json_response.py ``model_json_response``) or, for stream chunks, ``model_dump_json()``
(serving_chat.py ``_generate_chat_stream``); ``/generate`` items with ``dumps_json``
(orjson, ``ORJSON_RESPONSE_OPTIONS``); routes as base64 of flat int32 bytes
(detokenizer_manager.py ``_b64_encode_per_request``). The ``meta_info`` dicts and the
interleaving of a batch stream follow tokenizer_manager.py. Run with the unpacked sglang
0.5.23 wheel on the path and an environment with pydantic, orjson and pybase64:

    PYTHONPATH=<unpacked sglang wheel> python tests/wire/producer_bodies/sglang_0_5_23/generate.py \\
        tests/wire/producer_bodies/sglang_0_5_23

It writes ``<case>.body`` and ``expected.json`` (per choice: lengths, start, rows or null,
mask), which tests/wire/test_wire_producers_sglang_bytes.py reads.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pybase64
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    SglExt,
    UsageInfo,
)
from sglang.srt.utils.json_response import dumps_json

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
cases: dict[str, dict] = {}
LAYERS, TOPK = 4, 2


def rows(n: int) -> np.ndarray:
    return rng.integers(0, 8, (n, LAYERS, TOPK)).astype(np.int32)


def b64(routes: np.ndarray) -> str:
    """``pybase64.b64encode(tensor.numpy().tobytes())`` of the int32 rows."""
    return pybase64.b64encode(routes.tobytes()).decode("utf-8")


def add(
    name: str, body: bytes, start: int, expected: list[dict], request: tuple | None = None
) -> None:
    """``request``: the request's (prompt_len, completion_len), for a body whose own counts
    do not place its rows (the test passes them as the loader would)."""
    (out / f"{name}.body").write_bytes(body)
    cases[name] = {"start": start, "choices": expected}
    if request is not None:
        cases[name]["request"] = list(request)


def completion_chunk(choices: list, **fields) -> CompletionStreamResponse:
    return CompletionStreamResponse(
        id="s", created=0, object="text_completion", model="m", choices=choices, **fields
    )


def meta_info(rid: str, prompt: int, completion: int, routes: np.ndarray | None, mask=None) -> dict:
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": completion},
        "prompt_tokens": prompt,
        "weight_version": "default",
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if mask is not None:
        meta["output_token_sampling_mask"] = mask
        meta["output_token_sampling_logprobs"] = [[0.0]] * len(mask)
        meta["output_token_sampling_mask_length"] = len(mask)
    if routes is not None:
        meta["routed_experts"] = b64(routes)
    return meta


def want(prompt: int, completion: int, routes: np.ndarray | None, mask=None) -> dict:
    return {
        "P": prompt,
        "C": completion,
        "rows": None if routes is None else routes.tolist(),
        "mask": mask,
    }


usage = UsageInfo(prompt_tokens=3, total_tokens=8, completion_tokens=5)

# chat n=2: sglext from ret[0] only
r0, r1 = rows(3 + 3 - 1 - 1), rows(3 + 2 - 1 - 1)
choices = [
    ChatCompletionResponseChoice(
        index=i, message=ChatMessage(role="assistant", content="é/x"), finish_reason="length"
    )
    for i in range(2)
]
resp = ChatCompletionResponse(
    id="c",
    created=0,
    model="m",
    choices=choices,
    usage=usage,
    metadata={"weight_version": "default"},
    sglext=SglExt(routed_experts=b64(r0)),
)
add(
    "chat_n2_sglext",
    resp.model_dump_json(by_alias=True).encode(),
    1,
    [want(3, 3, r0), want(3, 2, None)],
)

# chat n=2 with return_meta_info: every choice its own meta_info, no sglext routes
mask0 = [[1, 2], [3], [4, 5, 6]]
choices = [
    ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content="a"),
        finish_reason="length",
        meta_info=meta_info("a", 3, 3, r0, mask0),
    ),
    ChatCompletionResponseChoice(
        index=1,
        message=ChatMessage(role="assistant", content="b"),
        finish_reason="length",
        meta_info=meta_info("b", 3, 2, r1),
    ),
]
resp = ChatCompletionResponse(id="c", created=0, model="m", choices=choices, usage=usage)
add(
    "chat_n2_meta_info",
    resp.model_dump_json(by_alias=True).encode(),
    1,
    [want(3, 3, r0, mask0), want(3, 2, r1)],
)

# completions, one choice with token ids
r = rows(4 + 2 - 1)
resp = CompletionResponse(
    id="c",
    created=0,
    model="m",
    choices=[
        CompletionResponseChoice(
            index=0,
            text="t",
            finish_reason="length",
            token_ids=[7, 8],
            prompt_token_ids=[1, 2, 3, 4],
        )
    ],
    usage=UsageInfo(prompt_tokens=4, total_tokens=6, completion_tokens=2),
    sglext=SglExt(routed_experts=b64(r)),
)
add("completions_sglext", resp.model_dump_json(by_alias=True).encode(), 0, [want(4, 2, r)])


def chunk(choices, **extra) -> str:
    return ChatCompletionStreamResponse(
        id="c", created=0, model="m", choices=choices, **extra
    ).model_dump_json()


def role(index: int) -> ChatCompletionResponseStreamChoice:
    return ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(role="assistant", content="")
    )


def text(index: int, finish: str | None = None) -> ChatCompletionResponseStreamChoice:
    return ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(content="x"), finish_reason=finish
    )


# chat stream n=2, choice 1 streams first: its routes are sent; ids framed in a second chunk
events = [
    chunk([role(1)]),
    chunk([role(0)]),
    chunk([text(1)]),
    chunk([text(0, "length")]),
    chunk([text(1, "length")]),
]
full = SglExt(routed_experts=b64(r1), input_ids=[1, 2, 3], output_ids=[[5, 6, 7], [8, 9]])
non_ids, ids = full.split_ids()
body = "".join(f"data: {e}\n\n" for e in events)
body += f"data: {chunk([], sglext=non_ids)}\n\n"
body += f"event: sglext_ids\ndata: {chunk([], sglext=ids)}\n\n"
body += f"data: {chunk([], usage=usage)}\n\n" + "data: [DONE]\n\n"
add("chat_stream_n2_framed", body.encode(), 1, [want(3, 3, None), want(3, 2, r1)])

# /generate batch stream: cumulative items interleaved, tagged with "index"
items = [(3, 3, rows(5)), (2, 2, rows(3))]
order = [(1, 1), (0, 1), (0, 2), (1, 2), (0, 3)]
body = b""
for index, upto in order:
    prompt, completion, routes = items[index]
    done = upto == completion
    meta = meta_info(f"r{index}", prompt, upto, routes if done else None)
    if not done:
        meta["finish_reason"] = None
    item = {"text": "x" * upto, "output_ids": list(range(upto)), "meta_info": meta, "index": index}
    body += b"data: " + dumps_json(item) + b"\n\n"
body += b"data: [DONE]\n\n"
add("generate_batch_stream", body, 0, [want(p, c, r) for p, c, r in items])

# /generate with a sampling mask
r = rows(3 + 3 - 1)
item = {"text": "x", "output_ids": [4, 5, 6], "meta_info": meta_info("g", 3, 3, r, mask0)}
add("generate_sampling_mask", dumps_json(item), 0, [want(3, 3, r, mask0)])

# Kimi-K3 chat (serving_chat.py ``chat_encoding_spec == "kimi_k3"``): ``_build_chat_response``
# rewrites every ret item's ``meta_info.prompt_tokens`` through ``_reported_prompt_tokens``
# (the model input less ``_KIMI_K3_GENERATION_STUB_TOKENS = 3``) before it builds usage and
# the choices' ``meta_info``; the routes still cover the model input ``[start, P + C - 1)``.
STUB = 3
P_K3, C_K3, S_K3 = 7, 3, 2
r = rows(P_K3 + C_K3 - 1 - S_K3)
reported = UsageInfo(
    prompt_tokens=P_K3 - STUB, total_tokens=P_K3 - STUB + C_K3, completion_tokens=C_K3
)


def k3_chat(meta: dict | None, **extra) -> bytes:
    """One choice of a Kimi-K3 chat response, with its rewritten ``meta_info`` if any."""
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content="k"),
        finish_reason="length",
        meta_info=meta,
    )
    resp = ChatCompletionResponse(
        id="c", created=0, model="m", choices=[choice], usage=reported, **extra
    )
    return resp.model_dump_json(by_alias=True).encode()


body = k3_chat(None, metadata={"weight_version": "default"}, sglext=SglExt(routed_experts=b64(r)))
add("chat_kimi_k3_sglext", body, S_K3, [want(P_K3, C_K3, r)], request=(P_K3, C_K3))

# the same with return_meta_info and a sampling mask: the choice's meta_info is rewritten too
mask_k3 = [[1], [2, 3], [4]]
meta = meta_info("k", P_K3, C_K3, r, mask_k3)
meta["prompt_tokens"] = P_K3 - STUB
add(
    "chat_kimi_k3_meta_info",
    k3_chat(meta),
    S_K3,
    [want(P_K3, C_K3, r, mask_k3)],
    request=(P_K3, C_K3),
)

# the chat stream: its usage chunk (include_usage) reports prompt_tokens[index], rewritten
# by _reported_prompt_tokens as each content arrives (_generate_chat_stream)
events = [chunk([role(0)]), chunk([text(0)]), chunk([text(0, "length")])]
body = "".join(f"data: {e}\n\n" for e in events)
body += f"data: {chunk([], sglext=SglExt(routed_experts=b64(r)))}\n\n"
body += f"data: {chunk([], usage=reported)}\n\n" + "data: [DONE]\n\n"
add("chat_kimi_k3_stream", body.encode(), S_K3, [want(P_K3, C_K3, r)], request=(P_K3, C_K3))

# /generate stream under --incremental-streaming-output with return_sampling_mask
# (tokenizer_manager.py ``_handle_batch_output``: each chunk's output_ids are the delta and
# ``_slice_streaming_output_meta_info`` cuts output_token_sampling_mask (and its logprobs)
# to the delta from ``state.last_output_offset``; output_token_sampling_mask_length and
# completion_tokens stay cumulative; the routes come whole, in the finishing chunk)
mask_inc = [[1, 2], [3], [4, 5], [6]]
r = rows(3 + 4 - 1)
body = b""
sent = 0
for upto in (1, 3, 4):
    done = upto == len(mask_inc)
    meta = meta_info("g", 3, upto, r if done else None, mask_inc[:upto])
    if not done:
        meta["finish_reason"] = None
    for key in ("output_token_sampling_mask", "output_token_sampling_logprobs"):
        meta[key] = meta[key][sent:]
    item = {"text": "x", "output_ids": list(range(sent, upto)), "meta_info": meta}
    item["prompt_token_ids"] = [1, 2, 3]
    body += b"data: " + dumps_json(item) + b"\n\n"
    sent = upto
body += b"data: [DONE]\n\n"
add("generate_stream_incremental_mask", body, 0, [want(3, 4, r, mask_inc)])

# /v1/completions stream (serving_completions.py ``_generate_completion_stream``), start 2: the
# routes of the first sequence come after its finishing chunk, in a chunk of no choices
# (``sglext``), then the counts in a usage chunk
r = rows(5 + 3 - 1 - 2)
body = ""
for i in range(3):
    streamed = CompletionResponseStreamChoice(
        index=0,
        text="a",
        logprobs=None,
        finish_reason="length" if i == 2 else None,
        matched_stop=None,
    )
    body += f"data: {completion_chunk([streamed]).model_dump_json()}\n\n"
body += f"data: {completion_chunk([], sglext=SglExt(routed_experts=b64(r))).model_dump_json()}\n\n"
counts = UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8)
body += f"data: {completion_chunk([], usage=counts).model_dump_json(exclude_none=True)}\n\n"
body += "data: [DONE]\n\n"
add("completions_stream", body.encode(), 2, [want(5, 3, r)])

(out / "expected.json").write_text(json.dumps(cases))
print("wrote", len(cases), "bodies to", out)
