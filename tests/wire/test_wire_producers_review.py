"""Producer bodies as the producers ship them in late 2026 (sglang 0.5.23, skyrl 0.4.0,
renderers 0.1.12 wheels from PyPI): the cases the August research did not cover. Facts and
sources: /work/notes/producers.md, "Review 2026-12"."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from producer_bodies import common

from r3data.errors import EngineRoutesError, WireFormatError
from r3data.wire.producers import FORMATS, Lengths, detect

LAYERS, TOPK = 4, 2
engine_rows = functools.partial(common.engine_rows, layers=LAYERS, topk=TOPK)


def decode(name: str, body, lengths=(None, None), **options):
    entry = FORMATS[name]
    return entry.decode(body, entry.make_options(options), Lengths(*lengths))


def flat_int32(rows: np.ndarray) -> str:
    """SGLang's routes: base64 of the flat int32 bytes (detokenizer ``_b64_encode_per_request``)."""
    return common.b64_raw(rows.astype("<i4"))


# --- SGLang 0.5.23 chat: return_meta_info puts every choice's meta_info in the choice --------


def _meta_info(prompt: int, completion: int, routes: str | None) -> dict:
    meta = {
        "id": "req",
        "finish_reason": {"type": "length", "length": completion},
        "prompt_tokens": prompt,
        "weight_version": "default",
        "completion_tokens": completion,
        "cached_tokens": 0,
    }
    if routes is not None:
        meta["routed_experts"] = routes
    return meta


def _meta_info_chat(samples: list[tuple[list[int], list[int], np.ndarray]], start: int) -> bytes:
    """``/v1/chat/completions`` with ``return_meta_info`` and ``return_routed_experts``
    (serving_chat.py ``_build_chat_response``: ``sglext.routed_experts`` is None, each
    ``ChatCompletionResponseChoice.meta_info`` is its own ``ret_item["meta_info"]``)."""
    choices = []
    for index, (prompt, output, routes) in enumerate(samples):
        meta = _meta_info(len(prompt), len(output), flat_int32(routes[start:]))
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": "x", "reasoning_content": None},
                "logprobs": None,
                "finish_reason": "length",
                "matched_stop": None,
                "meta_info": meta,
            }
        )
    prompt_tokens = len(samples[0][0])
    completion_tokens = sum(len(s[1]) for s in samples)
    body = {
        "id": "req",
        "object": "chat.completion",
        "created": 1_760_000_000,
        "model": "tiny-moe",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        },
        "metadata": {"weight_version": "default"},
    }
    return common.orjson_body(body)


def test_sglang_chat_return_meta_info_gives_every_choice_its_own_routes():
    prompt = [1, 2, 3, 4]
    samples = [
        (prompt, [5, 6, 7], engine_rows(7, seed=1)),
        (prompt, [8, 9], engine_rows(6, seed=2)),
    ]
    raw = _meta_info_chat(samples, start=2)
    assert next(f.name for f in detect(raw)) == "sglang-openai"
    for body in (raw, FORMATS["sglang-openai"].parse(raw)):
        choices = decode("sglang-openai", body, num_layers=LAYERS, topk=TOPK, start=2)
        assert [c.choice for c in choices] == [0, 1]
        for choice, (_, output, routes) in zip(choices, samples, strict=True):
            (rows,) = choice.sources
            assert rows.pos == 2
            assert rows.meta["completion_len"] == len(output)
            np.testing.assert_array_equal(rows.array, routes[2:])
    (second,) = decode(
        "sglang-openai", raw, (4, 2), num_layers=LAYERS, topk=TOPK, start=2, choice=1
    )
    np.testing.assert_array_equal(second.sources[0].array, samples[1][2][2:])
    with pytest.raises(EngineRoutesError, match=r"expected 6 route rows .* found 4"):
        decode("sglang-openai", raw, (4, 3), num_layers=LAYERS, topk=TOPK, start=0, choice=0)
    with pytest.raises(
        WireFormatError, match=r"the response has 2 completion tokens, the request 3"
    ):
        decode("sglang-openai", raw, (4, 3), num_layers=LAYERS, topk=TOPK, start=2, choice=1)


def test_sglang_chat_return_meta_info_without_routes_is_missing_not_choice_zero():
    body = common.orjson_body(
        {
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {}, "meta_info": _meta_info(3, 2, None)},
                {
                    "index": 1,
                    "message": {},
                    "meta_info": _meta_info(3, 2, flat_int32(engine_rows(5))),
                },
            ],
            "sglext": {"cached_tokens_details": {"device": 0}},
        }
    )
    first, second = decode("sglang-openai", body, num_layers=LAYERS, topk=TOPK)
    assert first.sources == ()
    assert first.missing
    np.testing.assert_array_equal(second.sources[0].array, engine_rows(5))


# --- SGLang 0.5.23 chat stream: ids framed into their own sglext event ------------------------


def _chunk(choices: list[dict], **extra: object) -> bytes:
    return common.orjson_body(
        {
            "id": "req",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": choices,
            "usage": None,
            **extra,
        }
    )


def test_sglang_chat_stream_with_framed_ids_event_reads_the_routes():
    """With ``x-sglext-ids-framed: 1`` and ``return_input_ids_in_sglext`` /
    ``return_output_ids_in_sglext`` (serving_chat.py ``_generate_chat_stream``), the routes
    come in one ``"choices": []`` chunk's ``sglext`` and the ids in a second one, sent as
    ``event: sglext_ids``: two sglext chunks, one with routes."""
    prompt, output, routes = [1, 2, 3], [4, 5], engine_rows(5)
    content = [
        _chunk([{"index": 0, "delta": {"content": f"<{t}>"}, "finish_reason": None}])
        for t in output
    ]
    routed = _chunk([], sglext={"routed_experts": flat_int32(routes)})
    ids = _chunk([], sglext={"input_ids": prompt, "output_ids": [output]})
    raw = (
        b"".join(b"data: " + c + b"\n\n" for c in [*content, routed])
        + b"event: sglext_ids\ndata: "
        + ids
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )
    (choice,) = decode("sglang-openai", raw, (3, 2), num_layers=LAYERS, topk=TOPK)
    np.testing.assert_array_equal(choice.sources[0].array, routes)
    twice = raw.replace(ids, routed)
    with pytest.raises(WireFormatError, match=r"second 'sglext.routed_experts'"):
        decode("sglang-openai", twice, (3, 2), num_layers=LAYERS, topk=TOPK)
