"""Producer bodies as the producers ship them in late 2026 (sglang 0.5.23, skyrl 0.4.0,
renderers 0.1.12 wheels from PyPI): the cases the August research did not cover. Facts and
sources: /work/notes/producers.md, "Review 2026-12"."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


# --- vLLM 0.30+ tokens endpoint: the native sampling_mask (also what prime-rl now sends) -------


def _tokens_choice(index: int, output: list[int], routes: np.ndarray, mask: object) -> dict:
    """``GenerateTokensChoice`` in vLLM 0.32's field order (scale_out/token_in_token_out/
    protocol.py): ``sampling_mask`` is ``output.sampling_mask.token_ids``, one list of kept
    vocabulary ids per completion token."""
    return {
        "index": index,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": output,
        "routed_experts": common.npy_b64(routes.astype(np.uint8)),
        "sampling_mask": mask,
        "weight_versions": None,
        "logprobs": None,
    }


def _tokens_body(prompt: list[int] | None, choices: list[dict]) -> bytes:
    body = {
        "request_id": "r",
        "model": "m",
        "created": 0,
        "prompt_token_ids": prompt,
        "output_mode": "tokens",
        "choices": choices,
        "usage": None,
    }
    return common.starlette_body(body)


MASK = [[1, 5], [2], [3, 4, 9]]


def _mask_rows(choice) -> list[tuple[int, list[list[int]]]]:
    out = []
    for source in choice.sources:
        if source.field == "sampling_mask":
            ragged = source.array
            rows = [ragged.values[a:b].tolist() for a, b in itertools.pairwise(ragged.offsets)]
            out.append((source.pos, rows))
    return out


def test_vllm_tokens_endpoint_sampling_mask_rows_sit_at_the_completion_tokens():
    routes = engine_rows(8)  # prompt 5 + completion 3
    raw = _tokens_body([0, 1, 2, 3, 4], [_tokens_choice(0, [7, 8, 9], routes, MASK)])
    for body in (raw, FORMATS["vllm"].parse(raw)):
        (choice,) = decode("vllm", body)
        assert _mask_rows(choice) == [(5, MASK)]
        (rows,) = [s for s in choice.sources if s.field == "routed_experts"]
        np.testing.assert_array_equal(rows.array, routes)
    (unknown,) = decode(
        "vllm", _tokens_body(None, [_tokens_choice(0, [7, 8, 9], routes, MASK)]), (5, 3)
    )
    assert _mask_rows(unknown) == [(5, MASK)]
    masked_only = raw.replace(b'"routed_experts":"', b'"routed_experts":null,"x":"', 1)
    assert [f.name for f in detect(masked_only)] == ["vllm"]  # a mask, routes null
    nulled = _tokens_body([0, 1, 2, 3, 4], [_tokens_choice(0, [7, 8, 9], routes, None)])
    (plain,) = decode("vllm", nulled)
    assert _mask_rows(plain) == []
    assert [s.field for s in plain.sources] == ["routed_experts"]


def test_vllm_routes_alone_never_need_the_mask_placed():
    from r3data.wire.producers import vllm_routes

    routes = engine_rows(8)
    raw = _tokens_body(None, [_tokens_choice(0, [7, 8, 9], routes, MASK)])
    (rows,) = vllm_routes(raw)
    np.testing.assert_array_equal(rows.array, routes)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        ([[1, 5], [2]], r"expected one kept set per completion token \(3\), found 2"),
        ([[1, 5], [2], [-3]], r"token ids in \[0, 2147483647\], found \[-3, 5\]"),
        ([[1, 5], [2], [3.0]], r"expected lists of token ids"),
        ([[1, 5], [2], [True]], r"expected lists of token ids"),
        ([[1, 5], 2, [3]], r"expected lists of token ids"),
        ({"ids": [1]}, r"expected a list of kept-id lists"),
        (
            [[1, 5], [2], [2**63]],
            r"\[2\]: expected token ids in \[0, 2147483647\], found 9223372036854775808",
        ),
    ],
)
def test_vllm_sampling_mask_that_is_not_one_list_of_ids_per_token_is_refused(mask, match):
    raw = _tokens_body([0, 1, 2, 3, 4], [_tokens_choice(0, [7, 8, 9], engine_rows(8), mask)])
    with pytest.raises(WireFormatError, match=match):
        decode("vllm", raw)


def test_vllm_tokens_stream_sampling_mask_deltas_join_per_choice():
    """Stream chunks carry the mask rows of their delta (output_processor clears the chunks
    per delta); the routes come once, on the finishing chunk."""
    routes = [engine_rows(7, seed=1), engine_rows(6, seed=2)]  # prompt 4 + completion 3 / 2
    lens = [3, 2]
    events = []
    for step in range(3):
        for i in range(2):
            if step >= lens[i]:
                continue
            done = step == lens[i] - 1
            choice = {
                "index": i,
                "finish_reason": "length" if done else None,
                "stop_reason": None,
                "token_ids": [10 + step],
                "routed_experts": common.npy_b64(routes[i].astype(np.uint8)) if done else None,
                "sampling_mask": [[step, 10 + step]],
                "weight_versions": None,
                "logprobs": None,
            }
            chunk = {"request_id": "r", "usage": None, "output_mode": "tokens", "choices": [choice]}
            if step == 0 and i == 0:
                chunk = {
                    "request_id": "r",
                    "usage": None,
                    "prompt_token_ids": [0, 1, 2, 3],
                    "output_mode": "tokens",
                    "choices": [choice],
                }
            events.append(common.starlette_body(chunk))
    raw = common.sse(events)
    first, second = decode("vllm", raw)
    assert _mask_rows(first) == [(4, [[0, 10], [1, 11], [2, 12]])]
    assert _mask_rows(second) == [(4, [[0, 10], [1, 11]])]
    np.testing.assert_array_equal(first.sources[0].array, routes[0])


def test_vllm_tokens_stream_mask_rows_stay_with_their_delta_s_tokens():
    """Each chunk's mask rows are its delta's tokens' kept sets: a delta with more or fewer
    rows than tokens would shift every later kept set onto another token, though the total
    still matches the completion."""
    routes = engine_rows(7)  # prompt 4 + completion 3
    deltas = [([10, 11], [[1]]), ([12], [[2], [3]])]  # 2 tokens + 1 row, 1 token + 2 rows
    events = []
    for number, (ids, mask) in enumerate(deltas):
        done = number == len(deltas) - 1
        choice = {
            "index": 0,
            "finish_reason": "length" if done else None,
            "token_ids": ids,
            "routed_experts": common.npy_b64(routes.astype(np.uint8)) if done else None,
            "sampling_mask": mask,
        }
        chunk = {"request_id": "r", "choices": [choice]}
        if number == 0:
            chunk["prompt_token_ids"] = [0, 1, 2, 3]
        events.append(common.starlette_body(chunk))
    with pytest.raises(
        WireFormatError,
        match=r"event 0: choice 0 sampling_mask: expected one kept set per token of the delta "
        r"\(2\), found 1",
    ):
        decode("vllm", common.sse(events))


def test_primerl_tokens_endpoint_passes_vllm_sampling_mask_through():
    """renderers 0.1.12 (client.py ``generate``) reads prime-rl's ``choices[0].sampling_mask``
    as vLLM's native kept-id lists next to prime-rl's route envelope."""
    routes = engine_rows(8)
    envelope = {
        "data": common.b64_raw(routes.astype(np.uint8)),
        "shape": list(routes.shape),
        "start": 0,
        "dtype": "uint8",
    }
    choice = {
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
        "token_ids": [7, 8, 9],
        "routed_experts": envelope,
        "sampling_mask": MASK,
    }
    raw = common.starlette_body({"request_id": "r", "model": "m", "choices": [choice]})
    assert detect(raw)[0].name == "prime-rl"
    (got,) = decode("prime-rl", raw, (5, 3))
    assert _mask_rows(got) == [(5, MASK)]
    np.testing.assert_array_equal(
        next(s for s in got.sources if s.field == "routed_experts").array, routes
    )


@settings(max_examples=40, deadline=None)
@given(
    mask=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), min_size=1, max_size=8),
    prompt=st.integers(1, 6),
)
def test_vllm_sampling_mask_round_trips_any_kept_sets(mask, prompt):
    completion = len(mask)
    routes = engine_rows(prompt + completion)
    raw = _tokens_body(list(range(prompt)), [_tokens_choice(0, [1] * completion, routes, mask)])
    (choice,) = decode("vllm", raw)
    assert _mask_rows(choice) == [(prompt, mask)]


# --- SGLang /generate stream of a batch: items interleave, each with its "index" -------------


def test_sglang_generate_stream_of_a_batch_gives_each_item_its_routes():
    """A batched ``/generate`` stream (several prompts or ``n > 1``) interleaves the items'
    cumulative chunks as they come, each tagged ``"index"`` (tokenizer_manager.py
    ``_stream_batch_responses``); each item's routes are on its own last chunk."""
    items = [
        ([1, 2, 3], [4, 5, 6], engine_rows(6, seed=1)),
        ([1, 2], [7, 8], engine_rows(4, seed=2)),
    ]
    order = [(1, 1), (0, 1), (0, 2), (1, 2), (0, 3)]  # (index, tokens so far)
    events = []
    for index, upto in order:
        prompt, output, routes = items[index]
        done = upto == len(output)
        meta = _meta_info(len(prompt), upto, flat_int32(routes[1:]) if done else None)
        meta["id"] = f"rid-{index}"
        meta["finish_reason"] = meta["finish_reason"] if done else None
        chunk = {"text": "x" * upto, "output_ids": output[:upto], "meta_info": meta, "index": index}
        events.append(common.orjson_body(chunk))
    raw = common.sse(events)
    assert next(f.name for f in detect(raw)) == "sglang"
    first, second = decode("sglang", raw, num_layers=LAYERS, topk=TOPK, start=1)
    for choice, (_, output, routes) in zip((first, second), items, strict=True):
        (rows,) = choice.sources
        assert rows.pos == 1
        assert rows.meta["completion_len"] == len(output)
        np.testing.assert_array_equal(rows.array, routes[1:])
    (alone,) = decode("sglang", raw, (2, 2), num_layers=LAYERS, topk=TOPK, start=1, choice=1)
    np.testing.assert_array_equal(alone.sources[0].array, items[1][2][1:])
    events[3] = events[3].replace(b'"index":1}', b'"index":0}')  # item 0's routes, then more
    early = common.sse(events)
    with pytest.raises(WireFormatError, match=r"routes on event"):
        decode("sglang", early, num_layers=LAYERS, topk=TOPK, start=1)


# --- SGLang 0.5.23 return_sampling_mask: meta_info.output_token_sampling_mask -----------------


def test_sglang_output_token_sampling_mask_rows_sit_at_the_output_tokens():
    """tokenizer_manager.py: with ``return_sampling_mask`` ``meta_info`` carries
    ``output_token_sampling_mask`` (one kept-id list per output token, extended over a
    stream), ``output_token_sampling_logprobs`` and ``output_token_sampling_mask_length``."""
    output, routes = [4, 5, 6], engine_rows(6)  # prompt [1, 2, 3]
    meta = _meta_info(3, 3, flat_int32(routes))
    meta |= {
        "output_token_sampling_mask": MASK,
        "output_token_sampling_logprobs": [[0.0], [0.0], [0.0]],
        "output_token_sampling_mask_length": 3,
    }
    body = common.orjson_body({"text": "x", "output_ids": output, "meta_info": meta})
    (choice,) = decode("sglang", body, num_layers=LAYERS, topk=TOPK)
    assert _mask_rows(choice) == [(3, MASK)]
    np.testing.assert_array_equal(choice.sources[0].array, routes)
    chat = common.orjson_body(
        {"object": "chat.completion", "choices": [{"index": 0, "message": {}, "meta_info": meta}]}
    )
    (from_chat,) = decode("sglang-openai", chat, (3, 3), num_layers=LAYERS, topk=TOPK)
    assert _mask_rows(from_chat) == [(3, MASK)]
    short = body.replace(b"[[1,5],[2],[3,4,9]]", b"[[1,5],[2]]")
    with pytest.raises(WireFormatError, match=r"one kept set per completion token \(3\), found 2"):
        decode("sglang", short, num_layers=LAYERS, topk=TOPK)
    from r3data.wire.producers import sglang_routes

    (alone,) = sglang_routes(short, num_layers=LAYERS, topk=TOPK)  # routes need no mask
    np.testing.assert_array_equal(alone.array, routes)


def test_sglang_chat_stream_n2_routes_belong_to_the_choice_that_streamed_first():
    """serving_chat.py ``_generate_chat_stream`` keys ``routed_experts`` by choice index in
    the order the choices' first outputs arrive (each opens with a role chunk) and sends
    ``next(v for v in routed_experts.values() if v is not None)``: the first-arriving
    choice's routes, which need not be choice 0's."""
    routes = engine_rows(5, seed=7)  # prompt 3 + completion 2 of choice 1
    role = [
        _chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for i in (1, 0)
    ]
    content = [
        _chunk([{"index": i, "delta": {"content": "x"}, "finish_reason": None}]) for i in (1, 0, 1)
    ]
    routed = _chunk([], sglext={"routed_experts": flat_int32(routes)})
    raw = common.sse([*role, *content, routed])
    first, second = decode("sglang-openai", raw, num_layers=LAYERS, topk=TOPK)
    assert first.sources == ()
    assert first.missing
    np.testing.assert_array_equal(second.sources[0].array, routes)
    (alone,) = decode("sglang-openai", raw, (3, 2), num_layers=LAYERS, topk=TOPK, choice=1)
    np.testing.assert_array_equal(alone.sources[0].array, routes)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
)
def test_sglang_generate_batch_stream_any_interleaving(lengths, data):
    items = [
        ([1, 2], list(range(10, 10 + c)), engine_rows(2 + c, seed=i)) for i, c in enumerate(lengths)
    ]
    pending = [[(i, upto) for upto in range(1, c + 1)] for i, c in enumerate(lengths)]
    events = []
    while any(pending):
        i = data.draw(st.sampled_from([k for k, p in enumerate(pending) if p]))
        index, upto = pending[i].pop(0)
        prompt, output, routes = items[index]
        done = upto == len(output)
        meta = _meta_info(len(prompt), upto, flat_int32(routes) if done else None)
        chunk = {"text": "", "output_ids": output[:upto], "meta_info": meta, "index": index}
        events.append(common.orjson_body(chunk))
    choices = decode("sglang", common.sse(events), num_layers=LAYERS, topk=TOPK)
    assert len(choices) == len(items)
    for choice, (_, _, routes) in zip(choices, items, strict=True):
        np.testing.assert_array_equal(choice.sources[0].array, routes)


def test_sglang_sglext_ids_give_the_routed_choice_its_lengths():
    """``sglext.input_ids`` / ``sglext.output_ids`` (0.5.23) are the prompt's and each
    choice's ids: they check the routed choice's rows even with ``n > 1``."""
    routes = engine_rows(5)  # prompt 3 + completion 2 of choice 0
    ext = {
        "routed_experts": flat_int32(routes),
        "input_ids": [1, 2, 3],
        "output_ids": [[4, 5], [6]],
    }
    body = common.orjson_body(
        {"object": "chat.completion", "choices": [{"index": 0}, {"index": 1}], "sglext": ext}
    )
    first, _ = decode("sglang-openai", body, num_layers=LAYERS, topk=TOPK)
    assert first.sources[0].meta["prompt_len"] == 3
    assert first.sources[0].meta["completion_len"] == 2
    short = body.replace(b'"output_ids":[[4,5]', b'"output_ids":[[4]')
    with pytest.raises(EngineRoutesError, match=r"expected 3 route rows .* found 4"):
        decode("sglang-openai", short, num_layers=LAYERS, topk=TOPK)


def _framed_stream(*ids_events: dict) -> bytes:
    """A chat stream of one choice (prompt 3, completion 2), its routes in a ``"choices": []``
    chunk, then each of ``ids_events`` as an ``event: sglext_ids`` chunk."""
    content = _chunk([{"index": 0, "delta": {"content": "x"}, "finish_reason": None}])
    routed = _chunk([], sglext={"routed_experts": flat_int32(engine_rows(5))})
    framed = b"".join(
        b"event: sglext_ids\ndata: " + _chunk([], sglext=e) + b"\n\n" for e in ids_events
    )
    return b"data: " + content + b"\n\ndata: " + routed + b"\n\n" + framed + b"data: [DONE]\n\n"


def test_sglang_chat_stream_refuses_an_sglext_field_sent_twice():
    """SGLang sends each sglext field once (``SglExt.split_ids``: the ids in one chunk, the
    rest in the other): a repeated ids event, the same or another, is not merged silently
    (the later one gave other lengths that fit the same rows: prompt 2, completion 3)."""
    ids = {"input_ids": [1, 2, 3], "output_ids": [[4, 5]]}
    (choice,) = decode("sglang-openai", _framed_stream(ids), num_layers=LAYERS, topk=TOPK)
    assert (choice.sources[0].meta["prompt_len"], choice.sources[0].meta["completion_len"]) == (
        3,
        2,
    )
    other = {"input_ids": [1, 2], "output_ids": [[4, 5, 6]]}
    for repeated in ([ids, ids], [ids, other]):
        with pytest.raises(WireFormatError, match=r"event 3: a second 'sglext.input_ids'"):
            decode("sglang-openai", _framed_stream(*repeated), num_layers=LAYERS, topk=TOPK)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ({"input_ids": "abc"}, r"sglext.input_ids: expected a list of token ids, found str"),
        (
            {"output_ids": [4, 5]},
            r"sglext.output_ids\[0\]: expected a list of token ids, found int",
        ),
        ({"output_ids": {"0": [4, 5]}}, r"sglext.output_ids: expected a list .* found dict"),
        ({"output_ids": []}, r"sglext.output_ids: expected the ids of choice 0 .* found 0 lists"),
    ],
)
def test_sglang_sglext_ids_of_another_form_are_refused(ids, match):
    """``input_ids`` is a list of ids, ``output_ids`` one such list per choice (SglExt
    0.5.23): another form is an error, not lengths quietly left unchecked."""
    with pytest.raises(WireFormatError, match=match):
        decode("sglang-openai", _framed_stream(ids), num_layers=LAYERS, topk=TOPK)
