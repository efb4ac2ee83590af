"""r3data.loader end to end on every producer format: bodies built as each producer's serializer
builds them (tests/wire/producer_bodies), inline and by handle, kept-token masks with zero
counts, by-handle padded masks, prefill/decode roles, and typed errors for bad sources."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "wire"))
from producer_bodies import (
    common,
    nemorl_bodies,
    primerl_bodies,
    sglang_bodies,
    skyrl_bodies,
    vllm_bodies,
)

from r3data import loader
from r3data.errors import ConfigError, EngineRoutesError, TraceGapError, WireFormatError
from r3data.nodes import CollateOptions, TraceOptions
from r3data.trace import TraceBuilder
from r3data.wire import InlineRows

LAYERS, TOPK = 4, 2
SHAPE = {"num_layers": LAYERS, "topk": TOPK}


# expert ids from 1: a MoE row is never all zero (the screen's "missing")
engine_rows = functools.partial(common.engine_rows, layers=LAYERS, topk=TOPK, lowest_id=1)


def one_batch(requests, tokens, *, fields=("routed_experts",), on_gap="drop_routes", **options):
    sample = {"id": "s", "token_ids": np.arange(tokens), "requests": requests}
    ragged = tuple(f for f in fields if f != "routed_experts")
    (batch,) = loader(
        [sample],
        batch_size=1,
        prefetch=0,
        trace=TraceOptions(on_gap=on_gap, ragged_fields=ragged or ("sampling_mask",)),
        collate=CollateOptions(fields=fields, workers=1),
        **options,
    )
    return batch


def request(prompt_len, completion_len, *sources):
    return {"prompt_len": prompt_len, "completion_len": completion_len, "sources": list(sources)}


def check_routes(batch, rows: np.ndarray, valid_end: int) -> None:
    """The batch holds ``rows`` for positions [0, valid_end) and a placeholder after."""
    got = batch["routed_experts"][0].numpy()
    np.testing.assert_array_equal(got[:valid_end], rows[:valid_end])
    valid = batch["routed_experts_valid"][0].numpy()
    assert valid[:valid_end].all()
    assert not valid[valid_end:].any()


# --- inline, two turns where the producer has a prompt start ------------------------------------

ROWS = engine_rows(12)  # turn 1: prompt 4 + completion 3; turn 2: prompt 9 + completion 3
TURNS = ((4, 3), (9, 3))
TOKENS = 12


def _ids(n, at=0):
    return list(range(at, at + n))


def vllm_turn(p, c, start):
    sample = vllm_bodies.Sample(_ids(c, 100), ROWS[: p + c - 1])
    body = vllm_bodies.completion_body(
        [vllm_bodies.Prompt(_ids(p), [sample])], num_experts=8, prompt_start=start
    )
    return {"producer": "vllm", "response": body, "start": start}


def vllm_stream_turn(p, c, start):
    sample = vllm_bodies.Sample(_ids(c, 100), ROWS[: p + c - 1])
    body = vllm_bodies.tokens_stream(
        vllm_bodies.Prompt(_ids(p), [sample]), num_experts=8, prompt_start=start
    )
    return {"producer": "vllm", "response": body, "start": start}


def sglang_turn(p, c, start):
    item = sglang_bodies.Item(_ids(p), _ids(c, 100), ROWS[: p + c - 1])
    body = sglang_bodies.generate_body([item], start_len=start)
    return {"producer": "sglang", "response": body, "start": start, **SHAPE}


def sglang_openai_turn(p, c, start):
    item = sglang_bodies.Item(_ids(p), _ids(c, 100), ROWS[: p + c - 1])
    body = sglang_bodies.openai_stream(item, start_len=start)
    return {"producer": "sglang-openai", "response": body, "start": start, **SHAPE}


def sglang_057_turn(p, c, start):
    item = sglang_bodies.Item(_ids(p), _ids(c, 100), ROWS[: p + c - 1])
    body = sglang_bodies.generate_body([item], start_len=start, version="0.5.10")
    return {"producer": "sglang-0.5.7", "response": body, **SHAPE}


def primerl_turn(p, c, start):
    envelope = primerl_bodies.routed_experts_envelope(ROWS[start : p + c - 1], start=start)
    body = primerl_bodies.generate_body(
        [{"token_ids": _ids(c, 100), "routed_experts": envelope}], prompt_len=p
    )
    return {"producer": "prime-rl", "response": body}


def primerl_v1_turn(p, c, start):
    envelope = primerl_bodies.routed_experts_envelope(ROWS[: p + c - 1], version=1)
    body = primerl_bodies.generate_body(
        [{"token_ids": _ids(c, 100), "routed_experts": envelope}], prompt_len=p
    )
    return {"producer": "prime-rl", "response": body}


def skyrl_turn(p, c, start):
    rows = ROWS[start : p + c - 1].copy()
    if start:
        rows[0, 1, 0] = 300  # above 255: SkyRL sends int16
    body = skyrl_bodies.generate_body(_ids(c, 100), rows)
    return {"producer": "skyrl", "response": body, "start": start}


def skyrl_v1_turn(p, c, start):
    body = skyrl_bodies.generate_body(_ids(c, 100), ROWS[start : p + c - 1], version=1)
    return {"producer": "skyrl-v1", "response": body, "start": start}


def nemorl_turn(p, c, start):
    full = nemorl_bodies.aligned_rows(ROWS[: p + c - 1], p, c, num_experts=8)
    return {"producer": "nemo-rl", "response": nemorl_bodies.chat_body(full, _ids(c, 100))}


TURN_BUILDERS = {
    "vllm": vllm_turn,
    "vllm stream": vllm_stream_turn,
    "sglang": sglang_turn,
    "sglang-openai stream": sglang_openai_turn,
    "sglang-0.5.7": sglang_057_turn,
    "prime-rl": primerl_turn,
    "prime-rl v1": primerl_v1_turn,
    "skyrl": skyrl_turn,
    "skyrl-v1": skyrl_v1_turn,
    "nemo-rl": nemorl_turn,
}


@pytest.mark.parametrize("name", sorted(TURN_BUILDERS))
def test_two_turns_of_every_format_reach_their_positions(name):
    """Turn 2 asks only for its new rows where the producer has a prompt start (vLLM, SGLang
    0.5.12+, prime-rl v2+, SkyRL), else resends every row; either way the batch holds the
    engine's rows at every forwarded position."""
    requests = []
    for number, (p, c) in enumerate(TURNS):
        start = 0 if number == 0 else sum(TURNS[0]) - 1
        requests.append(request(p, c, TURN_BUILDERS[name](p, c, start)))
    batch = one_batch(requests, TOKENS)
    expected = ROWS.copy()
    if name == "skyrl":
        expected[TURNS[0][0] + TURNS[0][1] - 1, 1, 0] = 300
    check_routes(batch, expected, TOKENS - 1)


def test_vllm_021_moe_rows_and_prefix_cached_zero_rows():
    rows = engine_rows(8)
    sample = vllm_bodies.Sample(_ids(3, 100), rows)
    raw = vllm_bodies.completion_body_v021(
        [vllm_bodies.Prompt(_ids(5), [sample])], moe_layers=(1, 2, 3)
    )
    batch = one_batch([request(5, 3, {"producer": "vllm-0.21", "response": raw})], 8)
    check_routes(batch, rows[:, 1:], 7)  # MoE layers only
    cached = vllm_bodies.completion_body_v021(
        [vllm_bodies.Prompt(_ids(5), [sample])], moe_layers=(1, 2, 3), cached_prefix=2
    )
    with pytest.raises(TraceGapError, match=r"2 route rows at positions \[0, 2\) are missing"):
        one_batch([request(5, 3, {"producer": "vllm-0.21", "response": cached})], 8, on_gap="raise")


def test_nemorl_no_route_rows_are_gaps():
    rows = engine_rows(8)
    full = nemorl_bodies.aligned_rows(rows[:5], 5, 3, num_experts=8)  # positions 5, 6: -1
    source = {"producer": "nemo-rl", "response": nemorl_bodies.chat_body(full, [6, 7, 8])}
    with pytest.raises(TraceGapError, match=r"2 route rows at positions \[5, 7\) are missing"):
        one_batch([request(5, 3, source)], 8, on_gap="raise")
    batch = one_batch([request(5, 3, source)], 8)
    assert not batch["routed_experts_valid"][0].numpy().any()  # drop_routes: never replayed


def test_n_choices_name_the_samples_one():
    samples = [vllm_bodies.Sample([7, 8, 9], engine_rows(8, seed=s)) for s in (1, 2)]
    raw = vllm_bodies.chat_body(vllm_bodies.Prompt(_ids(5), samples), num_experts=8)
    source = {"producer": "vllm", "response": raw, "choice": 1}
    check_routes(one_batch([request(5, 3, source)], 8), samples[1].routes, 7)


# --- sampling masks and the sampled support ---------------------------------------------------


def test_kept_tokens_with_zero_counts_are_no_mask_in_the_batch():
    """count 0 (and a null kept_tokens) is no mask at that token: the full vocabulary. The
    batch keeps the row empty (length 0, -1 when padded) and not valid."""
    kept = [np.array([3, 9], np.int32), np.empty(0, np.int32), np.array([4], np.int32)]
    first = primerl_bodies.generate_body(
        [
            {
                "token_ids": [100, 101, 102],
                "routed_experts": primerl_bodies.routed_experts_envelope(ROWS[:6]),
                "kept_tokens": primerl_bodies.kept_tokens_field(kept, num_tokens=3),
            }
        ],
        prompt_len=4,
        with_kept_tokens=True,
    )
    second = primerl_bodies.generate_body(
        [
            {
                "token_ids": [200, 201, 202],
                "routed_experts": primerl_bodies.routed_experts_envelope(ROWS[6:11], start=6),
                "kept_tokens": None,  # every count 0
            }
        ],
        prompt_len=9,
        with_kept_tokens=True,
    )
    batch = one_batch(
        [
            request(4, 3, {"producer": "prime-rl", "response": first}),
            request(9, 3, {"producer": "prime-rl", "response": second}),
        ],
        TOKENS,
        fields=("routed_experts", "sampling_mask"),
    )
    check_routes(batch, ROWS, TOKENS - 1)
    masks = batch["sampling_mask"]
    assert masks.lengths.tolist() == [TOKENS]
    assert masks.row_lengths.tolist() == [0] * 4 + [2, 0, 1] + [0] * 5
    assert (
        batch["sampling_mask_valid"][0].tolist() == [False] * 4 + [True, False, True] + [False] * 5
    )
    padded = masks.padded()[0].numpy()
    assert padded[4].tolist() == [3, 9]
    assert padded[6].tolist() == [4, -1]
    assert (padded[5] == -1).all()


def test_vllm_tokens_endpoint_masks_reach_the_batch_at_their_tokens():
    """The tokens endpoint's body as vLLM 0.32's own serializer wrote it (routes and the
    ``sampling_mask`` of every completion token), through the loader: the mask's rows sit at
    the completion tokens, the prompt's rows are empty and not valid."""
    bodies = Path(__file__).resolve().parents[1] / "wire" / "producer_bodies" / "vllm_0_32"
    (want,) = json.loads((bodies / "expected.json").read_text())["tokens"]
    prompt, completion = want["P"], want["C"]
    body = (bodies / "tokens.body").read_bytes()
    batch = one_batch(
        [request(prompt, completion, {"producer": "vllm", "response": body})],
        prompt + completion,
        fields=("routed_experts", "sampling_mask"),
    )
    rows = np.asarray(want["rows"], want["dtype"]).reshape(-1, LAYERS, TOPK)
    check_routes(batch, rows, prompt + completion - 1)
    masks = batch["sampling_mask"]
    widths = [len(kept) for kept in want["mask"]]
    assert masks.row_lengths.tolist() == [0] * prompt + widths
    assert batch["sampling_mask_valid"][0].tolist() == [False] * prompt + [True] * completion
    padded = masks.padded()[0].numpy()
    for row, kept in enumerate(want["mask"], start=prompt):
        assert padded[row, : len(kept)].tolist() == kept
        assert (padded[row, len(kept) :] == -1).all()


@pytest.mark.parametrize("on_gap", ["drop_routes", "drop_sample", "raise"])
def test_a_sample_whose_bodies_send_no_mask_keeps_its_routes_under_drop_routes(on_gap):
    """A batch asking for masks, of one sample whose body has them and one whose body has none
    (greedy sampling, an endpoint without masks): the second keeps its routes and gets empty,
    invalid mask rows; its missing rows are a gap like any other under the other policies."""
    bodies = Path(__file__).resolve().parents[1] / "wire" / "producer_bodies" / "vllm_0_32"
    (want,) = json.loads((bodies / "expected.json").read_text())["tokens"]
    prompt, completion = want["P"], want["C"]
    masked = (bodies / "tokens.body").read_bytes()
    rows = np.asarray(want["rows"], want["dtype"]).reshape(-1, LAYERS, TOPK)
    unmasked = vllm_bodies.Sample(_ids(completion, 100), rows)
    plain = vllm_bodies.completion_body(
        [vllm_bodies.Prompt(_ids(prompt), [unmasked])], num_experts=8, prompt_start=0
    )
    tokens = prompt + completion
    samples = [
        {
            "id": name,
            "token_ids": np.arange(tokens),
            "requests": [request(prompt, completion, {"producer": "vllm", "response": body})],
        }
        for name, body in (("masked", masked), ("plain", plain))
    ]
    options = {
        "batch_size": 2,
        "prefetch": 0,
        "trace": TraceOptions(on_gap=on_gap),
        "collate": CollateOptions(fields=("routed_experts", "sampling_mask"), workers=1),
    }
    if on_gap == "raise":
        with pytest.raises(TraceGapError, match=r"'plain'.*'sampling_mask': no rows for positions"):
            list(loader(samples, **options))
        return
    (batch,) = loader(samples, **options)
    if on_gap == "drop_sample":
        assert batch["sample_id"] == ["masked"]
        return
    assert batch["sample_id"] == ["masked", "plain"]
    for i in range(2):
        np.testing.assert_array_equal(batch["routed_experts"][i].numpy()[: tokens - 1], rows)
        assert batch["routed_experts_valid"][i].numpy()[: tokens - 1].all()
    masks = batch["sampling_mask"]
    widths = [len(kept) for kept in want["mask"]]
    assert masks.row_lengths.tolist() == [0] * prompt + widths + [0] * tokens
    assert batch["sampling_mask_valid"][1].tolist() == [False] * tokens
    assert masks.dtype == torch.int32  # the masked sample's ids, not widened or narrowed


def test_skyrl_sample_support_field():
    support = skyrl_bodies.sample_support([[5, 2], [7], [1, 3]], top_k=3)
    body = skyrl_bodies.generate_body([100, 101, 102], ROWS[:6], support=support)
    batch = one_batch(
        [request(4, 3, {"producer": "skyrl", "response": body})],
        7,
        fields=("routed_experts", "rollout_sample_support"),
    )
    check_routes(batch, ROWS, 6)
    field = batch["rollout_sample_support"]
    assert field.row_lengths.tolist() == [0] * 4 + [2, 1, 2]
    assert field.padded()[0].numpy()[4:].tolist() == [[5, 2], [7, -1], [1, 3]]


# --- by handle: the P/D router's merged payload, padded -1 masks --------------------------------


def test_by_handle_router_payload_with_padded_masks(tmp_path):
    rows = engine_rows(8)  # prompt 5 + completion 3
    stale = rows.copy()
    stale[:4] = 7  # the decode instance's prompt rows: never its own forwards
    mask = np.array([[3, 9, -1], [-1, -1, -1], [4, -1, -1]], np.int32)
    raw, files = primerl_bodies.pd_payload_request(
        rows[:5].astype(np.uint8), stale.astype(np.uint8), mask, [6, 7, 8]
    )
    (tmp_path / "v3").mkdir()
    for name, data in files.items():  # headerless: rows back to back
        (tmp_path / name).write_bytes(data)
    batch = one_batch(
        [request(5, 3, {"producer": "prime-rl", "response": raw})],
        8,
        payload_root=tmp_path,
        fields=("routed_experts", "sampling_mask"),
    )
    check_routes(batch, rows, 7)
    masks = batch["sampling_mask"]
    assert masks.row_lengths.tolist() == [0] * 5 + [2, 0, 1]
    assert batch["sampling_mask_valid"][0].tolist() == [False] * 5 + [True, False, True]
    assert masks.padded()[0].numpy()[5:].tolist() == [[3, 9], [-1, -1], [4, -1]]
    assert set(batch.metadata["files"][0]) == {"v3/p.bin", "v3/d.bin"}


# --- prefill/decode roles -----------------------------------------------------------------------


def _pd_sources():
    rows = engine_rows(8)  # prompt 5 + completion 3
    stale = rows.copy()
    stale[:5] = 7  # what the decode instance returns for the prompt: never forwarded there
    prompt = _ids(5)
    prefill = vllm_bodies.tokens_body(
        vllm_bodies.Prompt(prompt, [vllm_bodies.Sample([6], rows[:5])]), num_experts=8
    )
    decode = vllm_bodies.tokens_body(
        vllm_bodies.Prompt(prompt, [vllm_bodies.Sample([6, 7, 8], stale)]), num_experts=8
    )
    return (
        rows,
        {"producer": "vllm", "response": prefill, "role": "prefill"},
        {"producer": "vllm", "response": decode, "role": "decode"},
    )


@pytest.mark.parametrize("prefill_first", [True, False])
@pytest.mark.parametrize("one_request", [True, False])
def test_prefill_prompt_rows_win_over_decode_in_any_order(prefill_first, one_request):
    rows, prefill, decode = _pd_sources()
    sources = [prefill, decode] if prefill_first else [decode, prefill]
    if one_request:
        requests = [request(5, 3, *sources)]
    else:
        requests = [request(5, 3, source) for source in sources]
    check_routes(one_batch(requests, 8), rows, 7)


def test_a_decode_response_alone_leaves_the_prompt_a_gap():
    _, _, decode = _pd_sources()
    with pytest.raises(TraceGapError, match=r"no rows for positions \[0, 5\)"):
        one_batch([request(5, 3, decode)], 8, on_gap="raise")


# --- bad sources: typed errors naming producer, field, position ---------------------------------


def test_bad_sources_raise_typed_errors_naming_what_was_wrong():
    rows = engine_rows(8)
    raw = vllm_bodies.completion_body(
        [vllm_bodies.Prompt(_ids(5), [vllm_bodies.Sample([6, 7, 8], rows)])], num_experts=8
    )
    good = {"producer": "vllm", "response": raw}
    with pytest.raises(
        ConfigError,
        match=r"unknown option 'strat' \(did you mean 'start'\?\); valid options: choice, role, start",
    ):
        one_batch([request(5, 3, {**good, "strat": 2})], 8)
    with pytest.raises(ConfigError, match=r"role: expected one of \['full', 'prefill', 'decode'\]"):
        one_batch([request(5, 3, {**good, "role": "prefil"})], 8)
    with pytest.raises(
        ConfigError, match=r"producer: expected one of \[.*'vllm-0.21'\], found 'vlm'"
    ):
        one_batch([request(5, 3, {**good, "producer": "vlm"})], 8)
    with pytest.raises(
        EngineRoutesError, match=r"vllm choices\[0\].routed_experts: expected 6 route rows"
    ):
        one_batch([request(5, 3, {**good, "start": 1})], 8)
    at = raw.index(b'"routed_experts":"') + 200
    corrupt = raw[:at] + b"!" + raw[at + 1 :]
    with pytest.raises(
        WireFormatError, match=r"vllm choices\[0\].routed_experts: invalid base64 in characters \["
    ):
        one_batch([request(5, 3, {**good, "response": corrupt})], 8)
    skyrl = skyrl_bodies.generate_body([6, 7, 8], rows[1:], support=np.full((2, 2), -1, np.int32))
    with pytest.raises(
        WireFormatError,
        match=r"rollout_sample_support: expected one row per completion token \(3\), found 2 \(first position 5\)",
    ):
        one_batch(
            [request(5, 3, {"producer": "skyrl", "response": skyrl, "start": 1})],
            8,
            fields=("rollout_sample_support",),
        )


def test_the_trace_drops_a_decode_sources_prompt_rows():
    """The builder's one role rule: rows a decode instance sent for prompt positions go."""
    rows = engine_rows(8)
    builder = TraceBuilder("pd")
    decode = InlineRows("routed_experts", rows, 0, {"role": "decode"})
    prefill = InlineRows("routed_experts", rows[:5], 0, {"role": "prefill"})
    builder.add_request(5, 3, [decode, prefill])
    only_prompt = InlineRows("routed_experts", rows[:5], 0, {"role": "decode"})
    builder.add_request(5, 3, [only_prompt])  # nothing left of it
    pieces = builder.build().pieces["routed_experts"]
    assert [(p.pos, p.end, p.meta["role"]) for p in pieces] == [(0, 5, "prefill"), (5, 7, "decode")]
