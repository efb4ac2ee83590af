"""Self-test: every builder's body parses as JSON and decodes back to the engine's rows at
the positions the producer's source gives. Decoding here is plain numpy, independent of
r3data, so these bodies can be trusted as fixtures for r3data's decoders.

Run: ``PYTHONPATH=$PWD /work/main/.venv/bin/python -m pytest tests/wire/producer_bodies -q``
"""

from __future__ import annotations

import base64
import functools
import io
import json

import numpy as np
import pytest

from . import common, nemorl_bodies, primerl_bodies, sglang_bodies, skyrl_bodies, vllm_bodies

LAYERS, TOPK = 4, 2
MOE_LAYERS = (1, 2, 3)  # layer 0 dense


engine_rows = functools.partial(common.engine_rows, layers=LAYERS, topk=TOPK)


def npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def raw(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)


@pytest.mark.parametrize("version", ["0.22.0", "0.26.0", "0.33.0"])
def test_vllm_completion_rows_from_prompt_start(version):
    start = 3 if version >= "0.28" else 0
    prompts = [
        vllm_bodies.Prompt(
            [1, 2, 3, 4, 5], [vllm_bodies.Sample([7, 8, 9], engine_rows(8, seed=s)) for s in (1, 2)]
        ),
        vllm_bodies.Prompt([1, 2, 3, 4], [vllm_bodies.Sample([6], engine_rows(5, seed=3))]),
    ]
    body = json.loads(
        vllm_bodies.completion_body(prompts, num_experts=8, prompt_start=start, version=version)
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, (_prompt, sample) in zip(
        body["choices"], [(p, s) for p in prompts for s in p.samples], strict=True
    ):
        got = npy(choice["routed_experts"])
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, sample.routes[start:])
        assert (
            got.shape[0] == len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1 - start
        )


def test_vllm_uint16_above_256_experts_and_null_routes():
    rows = engine_rows(6, experts=300)
    prompt = vllm_bodies.Prompt(
        [1, 2, 3], [vllm_bodies.Sample([4, 5, 6], rows), vllm_bodies.Sample([4, 5, 6], None)]
    )
    body = json.loads(vllm_bodies.chat_body(prompt, num_experts=300))
    assert npy(body["choices"][0]["routed_experts"]).dtype == np.uint16
    assert body["choices"][1]["routed_experts"] is None
    assert body["prompt_token_ids"] == [1, 2, 3]
    assert "prompt_token_ids" not in body["choices"][0]


def test_vllm_021_split_format():
    rows = engine_rows(9)  # prompt 5 + completion 4
    prompt = vllm_bodies.Prompt([1, 2, 3, 4, 5], [vllm_bodies.Sample([6, 7, 8, 9], rows)])
    body = json.loads(
        vllm_bodies.completion_body_v021([prompt], moe_layers=MOE_LAYERS, cached_prefix=2)
    )
    pre = np.asarray(body["prompt_routed_experts"])
    gen = np.asarray(body["choices"][0]["routed_experts"])
    assert pre.shape == (5, 3, TOPK)
    assert gen.shape == (3, 3, TOPK)
    np.testing.assert_array_equal(pre[2:], rows[2:5, 1:])
    assert not pre[:2].any()  # prefix-cached positions stay zero in 0.21.0
    np.testing.assert_array_equal(gen, rows[5:, 1:])
    assert list(body)[:5] == ["id", "object", "created", "prompt_routed_experts", "model"]


def test_vllm_tokens_stream_routes_only_on_the_last_chunk():
    rows = engine_rows(8)
    prompt = vllm_bodies.Prompt([1, 2, 3, 4, 5], [vllm_bodies.Sample([6, 7, 8], rows)])
    events = [
        json.loads(line[6:])
        for line in vllm_bodies.tokens_stream(prompt, num_experts=8, prompt_start=2)
        .decode()
        .split("\n\n")
        if line.startswith("data: {")
    ]
    routes = [e["choices"][0]["routed_experts"] for e in events]
    assert routes[:-1] == [None] * (len(routes) - 1)
    np.testing.assert_array_equal(npy(routes[-1]), rows[2:])
    body = json.loads(vllm_bodies.tokens_body(prompt, num_experts=8, version="0.26.0"))
    np.testing.assert_array_equal(npy(body["choices"][0]["routed_experts"]), rows)


@pytest.mark.parametrize(("version", "first"), [("0.5.10", 0), ("0.5.23", 3)])
def test_sglang_generate_flat_int32(version, first):
    item = sglang_bodies.Item([1, 2, 3, 4, 5], [6, 7, 8], engine_rows(8))
    body = json.loads(sglang_bodies.generate_body([item], start_len=3, version=version))
    flat = raw(body["meta_info"]["routed_experts"], "<i4")
    np.testing.assert_array_equal(flat.reshape(-1, LAYERS, TOPK), item.routes[first:])
    assert "routed_experts_start_len" not in body["meta_info"]


def test_sglang_openai_response_level_first_choice_only():
    items = [sglang_bodies.Item([1, 2, 3], [4, 5], engine_rows(5, seed=s)) for s in (1, 2)]
    body = json.loads(sglang_bodies.openai_body(items, chat=True))
    assert all("sglext" not in c for c in body["choices"])
    flat = raw(body["sglext"]["routed_experts"], "<i4")
    np.testing.assert_array_equal(flat.reshape(-1, LAYERS, TOPK), items[0].routes)
    stream = sglang_bodies.openai_stream(items[0]).decode().split("\n\n")
    last = json.loads(stream[-3][6:])
    assert last["choices"] == []
    assert "routed_experts" in last["sglext"]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_primerl_envelope_versions(version):
    rows = engine_rows(8)[2:]
    env = primerl_bodies.routed_experts_envelope(rows, start=2, version=version)
    body = json.loads(
        primerl_bodies.generate_body(
            [{"token_ids": [6, 7, 8], "routed_experts": env}], prompt_len=5
        )
    )
    got = body["choices"][0]["routed_experts"]
    assert next(iter(got)) == "data"
    assert got.get("dtype", "uint8") == "uint8"
    assert got.get("start", 0) == (2 if version > 1 else 0)
    np.testing.assert_array_equal(
        raw(got["data"], got.get("dtype", "uint8")).reshape(got["shape"]), rows
    )


def test_primerl_uint16_and_kept_tokens():
    rows = engine_rows(6)
    assert primerl_bodies.routed_experts_envelope(rows)["dtype"] == "uint8"
    rows[0, 1, 0] = 511  # the dtype follows the ids present, not the model's expert count
    wide = primerl_bodies.routed_experts_envelope(rows)
    assert wide["dtype"] == "uint16"
    np.testing.assert_array_equal(raw(wide["data"], "<u2").reshape(wide["shape"]), rows)
    with pytest.raises(ValueError, match="<= 255"):
        primerl_bodies.routed_experts_envelope(rows, version=2)
    kept = [np.array([3, 9], np.int32), np.empty(0, np.int32), np.array([4], np.int32)]
    field = primerl_bodies.kept_tokens_field(kept, num_tokens=4)
    counts = raw(field["counts"], "<i4")
    assert counts.tolist() == [2, 0, 1, 0]
    assert raw(field["ids"], "<i4").tolist() == [3, 9, 4]
    assert primerl_bodies.kept_tokens_field([np.empty(0, np.int32)] * 3, num_tokens=3) is None
    body = json.loads(
        primerl_bodies.generate_body(
            [{"token_ids": [1, 2, 3], "routed_experts": None, "kept_tokens": None}],
            prompt_len=2,
            with_kept_tokens=True,
        )
    )
    assert body["choices"][0]["kept_tokens"] is None


def test_primerl_pd_merges():
    rows = engine_rows(8)  # prompt 5, completion 3
    prefill = primerl_bodies.routed_experts_envelope(rows[:5], start=0)
    stale = rows.copy()
    stale[:4] = 7  # the decode instance's prompt rows: not its own forwards
    decode = primerl_bodies.routed_experts_envelope(stale, start=0)
    merged = primerl_bodies.pd_merge_inline(prefill, decode)
    assert "dtype" not in merged
    np.testing.assert_array_equal(raw(merged["data"], "u1").reshape(merged["shape"]), rows)

    body_p, _ = primerl_bodies.payload_body(
        file="v3/p.bin", routes=rows[:5].astype(np.uint8), routes_pos=0
    )
    mask = np.array([[3, 9, -1], [-1, -1, -1], [4, -1, -1]], np.int32)
    body_d, blob = primerl_bodies.payload_body(
        file="v3/d.bin", routes=stale.astype(np.uint8), routes_pos=0, mask=mask, mask_pos=5
    )
    out = primerl_bodies.pd_merge_payload(json.loads(body_p), json.loads(body_d))
    segments = out["choices"][0]["payload"]
    assert [(s["file"], s["pos"], s["rows"]) for s in segments] == [
        ("v3/p.bin", 0, 5),
        ("v3/d.bin", 5, 2),
        ("v3/d.bin", 5, 3),
    ]
    clipped = segments[1]
    got = np.frombuffer(blob, np.uint8, count=2 * LAYERS * TOPK, offset=clipped["offset"])
    np.testing.assert_array_equal(got.reshape(2, LAYERS, TOPK), rows[5:])
    mseg = segments[2]
    np.testing.assert_array_equal(
        np.frombuffer(blob, "<i4", count=mask.size, offset=mseg["offset"]).reshape(3, 3), mask
    )


@pytest.mark.parametrize(("experts", "dtype"), [(8, "uint8"), (300, "int16"), (40000, "int32")])
def test_skyrl_dtype_ladder(experts, dtype):
    rows = engine_rows(6)
    rows[0, 1, 0] = experts - 1
    body = json.loads(skyrl_bodies.generate_body([4, 5, 6], rows))
    env = body["choices"][0]["routed_experts"]
    assert env["dtype"] == dtype
    assert list(env) == ["data", "shape", "dtype"]
    np.testing.assert_array_equal(raw(env["data"], env["dtype"]).reshape(env["shape"]), rows)
    old = json.loads(skyrl_bodies.generate_body([4, 5, 6], rows, version=1))
    np.testing.assert_array_equal(np.asarray(old["choices"][0]["routed_experts"]), rows)


def test_skyrl_sample_support():
    support = skyrl_bodies.sample_support([[5, 2], [7], []], top_k=3)
    body = json.loads(skyrl_bodies.generate_body([1, 2, 3], None, support=support))
    env = body["choices"][0]["rollout_sample_support"]
    got = raw(env["data"], env["dtype"]).reshape(env["shape"])
    assert got.tolist() == [[5, 2, -1], [7, -1, -1], [-1, -1, -1]]
    assert body["choices"][0]["routed_experts"] is None


def test_nemorl_envelope_string_with_missing_and_placeholder_rows():
    rows = engine_rows(8)  # prompt 5 + completion 3: 7 engine rows
    full = nemorl_bodies.aligned_rows(rows[:5], 5, 3, num_experts=8)
    body = json.loads(nemorl_bodies.chat_body(full, [6, 7, 8]))
    text = body["choices"][0]["message"]["routed_experts"]
    magic, dtype, shape, data = text.split(":", 3)
    assert (magic, dtype, shape) == ("nrlre1", "int8", f"8x{LAYERS}x{TOPK}")
    got = raw(data, dtype).reshape(8, LAYERS, TOPK)
    np.testing.assert_array_equal(got[:5], rows[:5])
    assert (got[5:7] == -1).all()
    np.testing.assert_array_equal(got[7], np.broadcast_to(np.arange(TOPK), (LAYERS, TOPK)))
