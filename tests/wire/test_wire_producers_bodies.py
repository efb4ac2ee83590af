"""Every registry format against bodies built the way its producer's serializer builds them
(tests/wire/producer_bodies): decoded rows equal the engine's at the right positions, raw and
spliced by ``load_packed_body`` alike, and ``detect`` names the format."""

from __future__ import annotations

import functools
import json

import numpy as np
import orjson
import pytest
from producer_bodies import (
    common,
    nemorl_bodies,
    primerl_bodies,
    sglang_bodies,
    skyrl_bodies,
    vllm_bodies,
)

from r3data.errors import ConfigError, EngineRoutesError, WireFormatError
from r3data.payload import PayloadSegment
from r3data.ragged import RaggedRows
from r3data.wire import EncodedRows, InlineRows, load_packed_body
from r3data.wire.producers import FORMATS, Lengths, detect

LAYERS, TOPK = 4, 2
MOE = (1, 2, 3)  # layer 0 is dense


engine_rows = functools.partial(common.engine_rows, layers=LAYERS, topk=TOPK)


def decode(name: str, body, lengths=(None, None), fields=None, **options):
    entry = FORMATS[name]
    found = frozenset(fields) if fields else None
    return entry.decode(body, entry.make_options(options), Lengths(*lengths), found)


def spliced(name: str, raw: bytes):
    """The body as ``load_packed_body`` gives it for the format's blobs (decoded in place)."""
    return load_packed_body(raw, FORMATS[name].spliced)


def routes_of(choice) -> list[tuple[int, np.ndarray]]:
    return [(s.pos, s.array) for s in choice.sources if s.field == "routed_experts"]


def assert_rows(choice, *expected: tuple[int, np.ndarray]) -> None:
    got = routes_of(choice)
    assert [pos for pos, _ in got] == [pos for pos, _ in expected]
    for (_, array), (_, want) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(array, want)


# --- vLLM 0.22-0.33 ---------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "start"), [("0.22.0", 0), ("0.26.0", 0), ("0.33.0", 3)])
@pytest.mark.parametrize("echo", [False, True])
def test_vllm_completions_several_prompts_n_choices(version, start, echo):
    prompts = [
        vllm_bodies.Prompt(
            [1, 2, 3, 4, 5], [vllm_bodies.Sample([7, 8, 9], engine_rows(8, seed=s)) for s in (1, 2)]
        ),
        vllm_bodies.Prompt([1, 2, 3, 4], [vllm_bodies.Sample([6], engine_rows(5, seed=3))]),
    ]
    raw = vllm_bodies.completion_body(
        prompts, num_experts=8, prompt_start=start, echo=echo, version=version
    )
    samples = [s for p in prompts for s in p.samples]
    for body in (raw, spliced("vllm", raw)):
        choices = decode("vllm", body, start=start)
        assert [c.choice for c in choices] == [0, 1, 2]
        for choice, sample in zip(choices, samples, strict=True):
            assert_rows(choice, (start, sample.routes[start:]))
            (rows,) = choice.sources
            assert rows.dtype == np.uint8
            assert isinstance(rows, EncodedRows) == (body is raw)  # raw: still base64
        assert choices[2].sources[0].meta["prompt_len"] == 4
    (one,) = decode("vllm", raw, (4, 1), choice=2, start=start)
    assert one.choice == 2
    with pytest.raises(WireFormatError, match=r"the request 5; is this the request's response"):
        decode("vllm", raw, (5, 1), choice=2, start=start)
    assert [f.name for f in detect(raw)] == ["vllm"]


def test_vllm_chat_n2_with_a_null_choice_and_uint16():
    rows = engine_rows(6, experts=300)
    prompt = vllm_bodies.Prompt(
        [1, 2, 3], [vllm_bodies.Sample([4, 5, 6], rows), vllm_bodies.Sample([4, 5, 6], None)]
    )
    raw = vllm_bodies.chat_body(prompt, num_experts=300)
    first, second = decode("vllm", raw)
    assert_rows(first, (0, rows))
    assert first.sources[0].dtype == np.uint16
    assert first.sources[0].meta["prompt_len"] == 3  # chat: prompt_token_ids at the top level
    assert (second.sources, second.missing) == ((), ("vllm choices[1].routed_experts",))
    with pytest.raises(EngineRoutesError, match=r"expected 4 route rows .*found 5"):
        decode("vllm", raw, choice=0, start=1)


def test_vllm_tokens_endpoint_body_and_stream():
    rows = engine_rows(8)
    prompt = vllm_bodies.Prompt([1, 2, 3, 4, 5], [vllm_bodies.Sample([6, 7, 8], rows)])
    for version in ("0.26.0", "0.33.0"):
        (choice,) = decode(
            "vllm", vllm_bodies.tokens_body(prompt, num_experts=8, version=version), (5, 3)
        )
        assert_rows(choice, (0, rows))
    stream = vllm_bodies.tokens_stream(prompt, num_experts=8, prompt_start=2, tokens_per_chunk=1)
    (choice,) = decode("vllm", stream, (5, 3), start=2)  # routes on the finishing chunk only
    assert_rows(choice, (2, rows[2:]))
    assert choice.sources[0].meta["completion_len"] == 3  # token ids of every chunk
    with pytest.raises(EngineRoutesError, match=r"expected 6 route rows .*found 5"):
        decode("vllm", stream, (5, 3), start=2 - 1)
    assert [f.name for f in detect(stream)] == ["vllm"]


def test_vllm_openai_streams_carry_no_routes():
    prompt = vllm_bodies.Prompt([1, 2], [vllm_bodies.Sample([3, 4], engine_rows(4))])
    stream = vllm_bodies.openai_stream_chunks(prompt)
    assert detect(stream) == []
    (choice,) = decode("vllm", stream)
    assert (choice.sources, choice.missing) == ((), ("vllm choices[0].routed_experts",))


def test_vllm_streams_with_routes_twice_or_early_are_refused():
    prompt = vllm_bodies.Prompt([1, 2, 3], [vllm_bodies.Sample([4, 5, 6], engine_rows(6))])
    stream = vllm_bodies.tokens_stream(prompt, num_experts=8, tokens_per_chunk=1)
    events = stream.split(b"\n\n")
    twice = b"\n\n".join([events[-3], *events])
    with pytest.raises(
        WireFormatError, match=r"event 3: choice 0 carries routes again \(first on event 0\)"
    ):
        decode("vllm", twice)
    early = stream.replace(b'"finish_reason":"length"', b'"finish_reason":null')
    with pytest.raises(WireFormatError, match="before it finished"):
        decode("vllm", early)


def test_vllm_streams_with_two_prompts_are_refused():
    """A stream whose chunks disagree on the prompt is two requests' chunks mixed: refused,
    whichever chunk repeats it; the same prompt repeated is the one request."""
    prompt = vllm_bodies.Prompt([1, 2, 3], [vllm_bodies.Sample([4, 5, 6], engine_rows(6))])
    events = vllm_bodies.tokens_stream(
        prompt, num_experts=8, tokens_per_chunk=1, return_token_ids=True
    ).split(b"\n\n")
    first = orjson.loads(events[0].removeprefix(b"data: "))
    assert first["prompt_token_ids"] == [1, 2, 3]
    for number in range(1, len(events) - 2):
        for ids, refused in (([1, 2, 3], False), ([1, 2, 4], True), ([1, 2], True)):
            chunk = orjson.loads(events[number].removeprefix(b"data: "))
            body = b"\n\n".join(
                [
                    *events[:number],
                    b"data: " + orjson.dumps(chunk | {"prompt_token_ids": ids}),
                    *events[number + 1 :],
                ]
            )
            if refused:
                with pytest.raises(WireFormatError, match=rf"event {number}: expected the prompt"):
                    decode("vllm", body)
            else:
                (choice,) = decode("vllm", body)
                assert_rows(choice, (0, engine_rows(6)))


# --- vLLM 0.21 ---------------------------------------------------------------------------------


def test_vllm_021_split_rows_are_moe_layers_at_their_positions():
    rows = engine_rows(9)  # prompt 5 + completion 4
    prompt = vllm_bodies.Prompt([1, 2, 3, 4, 5], [vllm_bodies.Sample([6, 7, 8, 9], rows)])
    raw = vllm_bodies.completion_body_v021([prompt], moe_layers=MOE, cached_prefix=2)
    (choice,) = decode("vllm-0.21", raw, (5, 4))
    moe = rows[:, list(MOE)]
    cached = moe.copy()
    cached[:2] = 0  # prefix-cached positions: zero rows, which the screen finds missing
    assert_rows(choice, (0, cached[:5]), (5, moe[5:]))
    assert {s.meta["layer_axis"] for s in choice.sources} == {"moe"}
    assert all(isinstance(s, InlineRows) for s in choice.sources)
    assert [f.name for f in detect(raw)] == ["vllm-0.21"]


def test_vllm_021_several_prompts_chat_n2_and_a_single_token():
    first = vllm_bodies.Prompt([1, 2, 3], [vllm_bodies.Sample([4, 5], engine_rows(5, seed=1))])
    other = vllm_bodies.Prompt([7, 8], [vllm_bodies.Sample([9], engine_rows(3, seed=2))])
    a, b = decode("vllm-0.21", vllm_bodies.completion_body_v021([first, other], moe_layers=MOE))
    assert_rows(a, (0, first.samples[0].routes[:3, 1:]), (3, first.samples[0].routes[3:, 1:]))
    assert b.sources == ()  # one completion token: no generated rows, and no prompt rows sent
    assert b.missing == ("vllm-0.21 prompt_routed_experts (for choice 1)",)
    samples = [vllm_bodies.Sample([4, 5, 6], engine_rows(6, seed=s)) for s in (3, 4)]
    chat = vllm_bodies.chat_body_v021(vllm_bodies.Prompt([1, 2, 3], samples), moe_layers=MOE)
    bare = vllm_bodies.chat_body_v021(
        vllm_bodies.Prompt([1, 2, 3], samples), moe_layers=MOE, return_token_ids=False
    )
    for choice, sample in zip(decode("vllm-0.21", chat), samples, strict=True):
        prompt_rows = samples[-1].routes[:3, 1:]  # the last child to finish sent them
        assert_rows(choice, (0, prompt_rows), (3, sample.routes[3:, 1:]))
    with pytest.raises(EngineRoutesError, match=r"expected 4 rows \(one per prompt token"):
        decode("vllm-0.21", bare, (4, 3), choice=0)


def test_vllm_021_prompt_rows_go_to_choice_0_by_its_index_whatever_the_list_order():
    """``prompt_routed_experts`` are choice 0's prompt's rows; a choice of another prompt of
    the same length listed first must not take them (it once compared with list position 0)."""
    first = vllm_bodies.Prompt([1, 2, 3], [vllm_bodies.Sample([4, 5], engine_rows(5, seed=5))])
    other = vllm_bodies.Prompt([7, 8, 9], [vllm_bodies.Sample([6, 5], engine_rows(5, seed=6))])
    doc = orjson.loads(vllm_bodies.completion_body_v021([first, other], moe_layers=MOE))
    in_order = [(routes_of(c), c.missing) for c in decode("vllm-0.21", orjson.dumps(doc))]
    doc["choices"].reverse()
    assert [c["index"] for c in doc["choices"]] == [1, 0]
    a, b = decode("vllm-0.21", orjson.dumps(doc))
    assert_rows(a, (0, first.samples[0].routes[:3, 1:]), (3, first.samples[0].routes[3:, 1:]))
    assert [s.pos for s in b.sources] == [3]  # its generated rows only
    assert b.missing == ("vllm-0.21 prompt_routed_experts (for choice 1)",)
    for choice, (rows, missing) in zip((a, b), in_order, strict=True):
        assert_rows(choice, *rows)
        assert choice.missing == missing


# --- SGLang ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "name"), [("0.5.10", "sglang-0.5.7"), ("0.5.23", "sglang")])
def test_sglang_generate_start_len_by_version(version, name):
    item = sglang_bodies.Item([1, 2, 3, 4, 5], [6, 7, 8], engine_rows(8))
    raw = sglang_bodies.generate_body([item], start_len=3, version=version)
    options = {"num_layers": LAYERS, "topk": TOPK} | ({"start": 3} if name == "sglang" else {})
    first = 3 if name == "sglang" else 0  # 0.5.7-0.5.11 ignore routed_experts_start_len
    for body in (raw, spliced(name, raw)):
        (choice,) = decode(name, body, (5, 3), **options)
        assert_rows(choice, (first, item.routes[first:]))
    assert [f.name for f in detect(raw)] == ["sglang", "sglang-0.5.7"]  # the same body
    with pytest.raises(
        ConfigError, match=r"unknown option 'start'; valid options: choice, num_layers, role, topk"
    ):
        FORMATS["sglang-0.5.7"].make_options({"num_layers": 4, "topk": 2, "start": 3})


def test_sglang_batches_and_streams():
    items = [sglang_bodies.Item([1, 2, 3], [4, 5], engine_rows(5, seed=s)) for s in (1, 2)]
    batch = sglang_bodies.generate_body(items, batched=True)
    choices = decode("sglang", batch, num_layers=LAYERS, topk=TOPK)
    for choice, item in zip(choices, items, strict=True):
        assert_rows(choice, (0, item.routes))
    (second,) = decode("sglang", batch, (3, 2), num_layers=LAYERS, topk=TOPK, choice=1)
    assert_rows(second, (0, items[1].routes))
    stream = sglang_bodies.generate_stream(items[0], start_len=1, tokens_per_chunk=1)
    (streamed,) = decode("sglang", stream, (3, 2), num_layers=LAYERS, topk=TOPK, start=1)
    assert_rows(streamed, (1, items[0].routes[1:]))  # the final chunk carries them
    with pytest.raises(WireFormatError, match=r"multiple of 6 int32 ids \(layers 3 x topk 2\)"):
        decode("sglang", batch, num_layers=3, topk=TOPK)


@pytest.mark.parametrize("chat", [True, False])
def test_sglang_openai_first_sequence_only(chat):
    items = [sglang_bodies.Item([1, 2, 3], [4, 5], engine_rows(5, seed=s)) for s in (1, 2)]
    raw = sglang_bodies.openai_body(items, chat=chat, start_len=2)
    first, second = decode("sglang-openai", raw, num_layers=LAYERS, topk=TOPK, start=2)
    assert_rows(first, (2, items[0].routes[2:]))
    assert second.sources == ()
    assert "first sequence only" in second.missing[0]
    assert detect(raw)[0].name == "sglang-openai"
    (alone,) = decode(
        "sglang-openai",
        sglang_bodies.openai_body(items[:1], chat=chat),
        num_layers=LAYERS,
        topk=TOPK,
    )
    assert alone.sources[0].meta["prompt_len"] == 3  # from usage: one choice
    stream = sglang_bodies.openai_stream(items[0], start_len=2)
    (streamed,) = decode("sglang-openai", stream, (3, 2), num_layers=LAYERS, topk=TOPK, start=2)
    assert_rows(streamed, (2, items[0].routes[2:]))
    assert detect(stream)[0].name == "sglang-openai"
    old = sglang_bodies.openai_body(items[:1], chat=chat, start_len=2, version="0.5.10")
    (ignored,) = decode("sglang-openai-0.5.9", old, num_layers=LAYERS, topk=TOPK)
    assert_rows(ignored, (0, items[0].routes))  # 0.5.9-0.5.11 do not forward the start


def test_stream_choice_indices_must_be_dense_not_a_count_to_allocate():
    """A short stream naming choice 10**9 is refused; it never makes 10**9 choices."""
    item = sglang_bodies.Item([1, 2, 3], [4, 5], engine_rows(5))
    prompt = vllm_bodies.Prompt([1, 2, 3], [vllm_bodies.Sample([4, 5], engine_rows(5))])
    streams = {
        "sglang-openai": (sglang_bodies.openai_stream(item), {"num_layers": LAYERS, "topk": TOPK}),
        "vllm": (vllm_bodies.tokens_stream(prompt, num_experts=8, tokens_per_chunk=1), {}),
    }
    for name, (stream, options) in streams.items():
        hostile = stream.replace(b'"index":0', b'"index":1000000000')
        assert hostile != stream
        with pytest.raises(WireFormatError, match=r"expected choice indices 0\.\.n-1"):
            decode(name, hostile, (3, 2), **options)


# --- prime-rl ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 3])
def test_primerl_envelopes_with_and_without_start_and_dtype(version):
    rows = engine_rows(8)  # prompt 5 + completion 3
    start = 0 if version == 1 else 2  # v1 had no prompt start: rows from 0
    envelope = primerl_bodies.routed_experts_envelope(rows[start:], start=start, version=version)
    raw = primerl_bodies.generate_body(
        [{"token_ids": [6, 7, 8], "routed_experts": envelope}], prompt_len=5
    )
    for body in (raw, spliced("prime-rl", raw)):
        (choice,) = decode("prime-rl", body, (5, 3))
        assert_rows(choice, (start, rows[start:]))
        assert choice.sources[0].dtype == np.uint8
    assert [f.name for f in detect(raw)] == ["prime-rl"]
    with pytest.raises(
        WireFormatError, match=r"the response has 3 completion tokens, the request 4"
    ):
        decode("prime-rl", raw, (5, 4))


def test_primerl_uint16_kept_tokens_with_zero_counts_and_null():
    rows = engine_rows(7)  # prompt 3 + completion 4
    rows[0, 1, 0] = 511
    kept = [np.array([3, 9], np.int32), np.empty(0, np.int32), np.array([4], np.int32)]
    choices = [
        {
            "token_ids": [1, 2, 3, 4],
            "routed_experts": primerl_bodies.routed_experts_envelope(rows),
            "kept_tokens": primerl_bodies.kept_tokens_field(kept, num_tokens=4),
        },
        {
            "token_ids": [1, 2, 3, 4],
            "routed_experts": primerl_bodies.routed_experts_envelope(rows),
            "kept_tokens": primerl_bodies.kept_tokens_field([np.empty(0, np.int32)], num_tokens=4),
        },
    ]
    raw = primerl_bodies.generate_body(choices, prompt_len=3, with_kept_tokens=True)
    assert json.loads(raw)["choices"][1]["kept_tokens"] is None
    for body in (raw, spliced("prime-rl", raw)):
        first, second = decode("prime-rl", body, (3, 4))
        routes, mask = first.sources
        assert routes.dtype == np.uint16
        np.testing.assert_array_equal(routes.array, rows)
        assert (mask.field, mask.pos) == ("sampling_mask", 3)
        assert mask.array == RaggedRows.from_rows([[3, 9], [], [4], []])  # 0: no mask there
        null = second.sources[1]
        assert (null.pos, null.rows, null.array.values.size) == (3, 4, 0)  # no mask anywhere
    with pytest.raises(WireFormatError, match="cannot place the mask rows without the prompt"):
        decode("prime-rl", raw)
    (routes_only,) = decode("prime-rl", raw, fields={"routed_experts"}, choice=0)
    assert [s.field for s in routes_only.sources] == ["routed_experts"]


def test_primerl_pd_merges_inline_and_by_handle():
    rows = engine_rows(8)  # prompt 5 + completion 3
    stale = rows.copy()
    stale[:4] = 7
    merged = primerl_bodies.pd_merge_inline(
        primerl_bodies.routed_experts_envelope(rows[:5]),
        primerl_bodies.routed_experts_envelope(stale),
    )
    raw = primerl_bodies.generate_body(
        [{"token_ids": [6, 7, 8], "routed_experts": merged}], prompt_len=5
    )
    (choice,) = decode("prime-rl", raw, (5, 3))
    assert_rows(choice, (0, rows))
    mask = np.array([[3, 9, -1], [-1, -1, -1], [4, -1, -1]], np.int32)
    raw, _ = primerl_bodies.pd_payload_request(
        rows[:5].astype(np.uint8), stale.astype(np.uint8), mask, [6, 7, 8]
    )
    (choice,) = decode("prime-rl", raw, (5, 3))
    assert all(isinstance(s, PayloadSegment) for s in choice.sources)
    assert [(s.field, s.file, s.pos, s.rows) for s in choice.sources] == [
        ("routed_experts", "v3/p.bin", 0, 5),
        ("routed_experts", "v3/d.bin", 5, 2),
        ("sampling_mask", "v3/d.bin", 5, 3),
    ]
    assert choice.missing == ()
    assert [f.name for f in detect(raw)] == ["prime-rl"]
    with pytest.raises(ConfigError, match="role 'decode' applies to inline rows"):
        decode("prime-rl", raw, role="decode")


# --- SkyRL -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.uint8), (300, np.int16), (40000, np.int32)])
def test_skyrl_compact_ladder(experts, dtype):
    rows = engine_rows(6)[2:]  # rows from the request's prompt start 2
    rows[0, 1, 0] = experts - 1
    raw = skyrl_bodies.generate_body([4, 5, 6], rows)
    for body in (raw, spliced("skyrl", raw)):
        (choice,) = decode("skyrl", body, (3, 3), start=2)
        assert_rows(choice, (2, rows))
        assert choice.sources[0].dtype == dtype
    assert [f.name for f in detect(raw)] == ["skyrl"]
    old = skyrl_bodies.generate_body([4, 5, 6], rows, version=1)
    (choice,) = decode("skyrl-v1", old, (3, 3), start=2)
    assert_rows(choice, (2, rows))
    assert [f.name for f in detect(old)] == ["skyrl-v1"]


def test_skyrl_sample_support_rows_sit_on_completion_tokens():
    support = skyrl_bodies.sample_support([[5, 2], [7], []], top_k=3)
    rows = engine_rows(6)
    raw = skyrl_bodies.generate_body([1, 2, 3], rows, support=support)
    for body in (raw, spliced("skyrl", raw)):
        (choice,) = decode("skyrl", body, (3, 3))
        routes, kept = choice.sources
        np.testing.assert_array_equal(routes.array, rows)
        assert (kept.field, kept.pos, kept.end) == ("rollout_sample_support", 3, 6)
        assert kept.array == RaggedRows.from_rows([[5, 2], [7], []])
    none = skyrl_bodies.generate_body([1, 2, 3], None, support=support)
    (choice,) = decode("skyrl", none, (3, 3))
    assert [s.field for s in choice.sources] == ["rollout_sample_support"]
    assert choice.missing == ("skyrl choices[0].routed_experts",)


# --- NeMo-RL -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.int8), (300, np.int16)])
@pytest.mark.parametrize("legacy", [False, True])
def test_nemorl_rows_drop_the_placeholder_last_row(experts, dtype, legacy):
    rows = engine_rows(8, experts=experts)  # prompt 5 + completion 3: 7 engine rows
    full = nemorl_bodies.aligned_rows(rows[:5], 5, 3, num_experts=experts)  # 2 rows missing
    raw = nemorl_bodies.chat_body(full, [6, 7, 8], legacy_lists=legacy)
    (choice,) = decode("nemo-rl", raw, (5, 3))
    (got,) = choice.sources
    assert (got.pos, got.rows) == (0, 7)
    assert isinstance(got, EncodedRows) != legacy  # the string stays encoded
    np.testing.assert_array_equal(got.array[:5], rows[:5])
    assert (got.array[5:] == -1).all()  # no route: the screen finds them missing
    if not legacy:
        assert got.dtype == dtype
    assert [f.name for f in detect(raw)] == ["nemo-rl"]
    with pytest.raises(EngineRoutesError, match=r"expected 9 rows .* found 8"):
        decode("nemo-rl", raw, (6, 3))  # the body has no prompt ids: the request's length


def test_nemorl_token_ids_in_the_message_check_the_rows():
    """NeMo-RL attaches the prompt and generation ids to each choice's message: they give the
    lengths the request did not, and a body whose rows disagree with them is refused."""
    rows = engine_rows(8)  # prompt 5 + completion 3
    full = nemorl_bodies.aligned_rows(rows, 5, 3, num_experts=8)
    raw = nemorl_bodies.chat_body(full, [6, 7, 8], prompt_ids=[1, 2, 3, 4, 5])
    (choice,) = decode("nemo-rl", raw)
    (got,) = choice.sources
    assert (got.pos, got.rows) == (0, 7)
    np.testing.assert_array_equal(got.array, rows[:7])
    short = nemorl_bodies.chat_body(full, [6, 7, 8], prompt_ids=[1, 2, 3, 4])
    with pytest.raises(EngineRoutesError, match=r"expected 7 rows \(prompt 4 \+ completion 3"):
        decode("nemo-rl", short)


def test_nemorl_token_ids_of_the_message_and_of_vllm_must_agree():
    full = nemorl_bodies.aligned_rows(engine_rows(8), 5, 3, num_experts=8)
    body = orjson.loads(nemorl_bodies.chat_body(full, [6, 7, 8], prompt_ids=[1, 2, 3, 4, 5]))
    body["choices"][0]["token_ids"] = [6, 7]  # vLLM's own list of the completion
    with pytest.raises(WireFormatError, match=r"message's completion ids .* \(2\), found 3"):
        decode("nemo-rl", orjson.dumps(body))
