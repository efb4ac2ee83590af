"""Producer formats: vLLM, SGLang, prime-rl and SkyRL responses to InlineRows."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
from typing import ClassVar

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import ConfigError, EngineRoutesError, R3DataError, WireFormatError
from r3data.nodes.screen import dense_layers
from r3data.wire import (
    EncodedRows,
    load_packed_body,
    pack_csr,
    pack_ndarray,
    primerl_routes,
    primerl_sampling_mask,
    read_npy,
    sglang_routes,
    skyrl_routes,
    vllm_routes,
)

SETTINGS = settings(max_examples=30, deadline=None)


def _routes(rows: int, layers: int = 4, topk: int = 2, dtype=np.uint8, seed: int = 0):
    """Distinct experts per row (as a router picks them), never all zero."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((rows, layers, 64)), axis=-1)[..., :topk] + 1
    return experts.astype(dtype)


def _npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _http(body: dict) -> bytes:
    """As vLLM's server writes a JSONResponse (Starlette: compact, UTF-8)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def vllm_response(routes, prompt_len, completion_lens, *, chat=False):
    choices = []
    for index, (array, completion) in enumerate(zip(routes, completion_lens, strict=True)):
        choice = {
            "index": index,
            "text": "ok",
            "token_ids": list(range(completion)),
            "routed_experts": None if array is None else _npy_b64(array),
            "finish_reason": "stop",
        }
        if not chat:
            choice["prompt_token_ids"] = list(range(prompt_len))
        choices.append(choice)
    body = {"id": "cmpl-1", "object": "text_completion", "choices": choices}
    if chat:
        body["prompt_token_ids"] = list(range(prompt_len))
    return body


# --- vLLM ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("raw", [False, True])
def test_vllm_rows_cover_prompt_plus_completion_minus_one(dtype, chat, raw):
    prompt_len, completions = 7, [5, 3]
    arrays = [_routes(prompt_len + c - 1, dtype=dtype, seed=c) for c in completions]
    body = vllm_response(arrays, prompt_len, completions, chat=chat)
    rows = vllm_routes(_http(body) if raw else orjson.loads(_http(body)))
    assert [r.pos for r in rows] == [0, 0]
    assert [r.end for r in rows] == [prompt_len + c - 1 for c in completions]
    for got, want in zip(rows, arrays, strict=True):
        np.testing.assert_array_equal(got.array, want)
        assert got.array.dtype == dtype
        assert got.field == "routed_experts"
    assert rows[1].meta["choice"] == 1
    assert (rows[1].meta["prompt_len"], rows[1].meta["completion_len"]) == (7, 3)


def test_vllm_prompt_start_argument_and_echo():
    array = _routes(10 + 4 - 1 - 6)
    body = vllm_response([array], 10, [4])
    (rows,) = vllm_routes(_http(body), prompt_start=6)
    assert (rows.pos, rows.end) == (6, 13)
    body["choices"][0]["routed_experts_prompt_start"] = 6
    assert vllm_routes(body)[0].pos == 6
    with pytest.raises(EngineRoutesError, match=r"expected 13 route rows .* found 7"):
        vllm_routes(body, prompt_start=0)


def test_vllm_without_token_ids_trusts_the_start():
    body = {"choices": [{"routed_experts": _npy_b64(_routes(3))}]}
    (rows,) = vllm_routes(body, prompt_start=2)
    assert (rows.pos, rows.rows, rows.meta["prompt_len"]) == (2, 3, None)


def test_vllm_one_row_fewer_is_an_engine_error():
    body = vllm_response([_routes(5)], 4, [3])
    with pytest.raises(
        EngineRoutesError, match=r"expected 6 route rows \(prompt 4 \+ completion 3"
    ):
        vllm_routes(body)


def test_vllm_choice_selection_and_missing_routes():
    body = vllm_response([_routes(5), None], 3, [3, 3])
    assert len(vllm_routes(body, choice=0)) == 1
    with pytest.raises(WireFormatError, match=r"choices\[1\].routed_experts: no routes"):
        vllm_routes(body)
    with pytest.raises(ConfigError, match="choice 2 out of range"):
        vllm_routes(body, choice=2)
    with pytest.raises(WireFormatError, match="'choices' list"):
        vllm_routes({"data": []})
    with pytest.raises(ConfigError, match="prompt_start"):
        vllm_routes(body, prompt_start=-1)


class _Tripwire:
    fired: ClassVar[list[str]] = []

    def __reduce__(self):
        return (_Tripwire.fired.append, ("unpickled!",))


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.zeros((2, 3, 2), np.float32), "float32"),
        (np.zeros((2, 3), np.uint8), r"\[rows, layers, topk\] array, found shape \(2, 3\)"),
        (np.asfortranarray(np.ones((2, 3, 2), np.uint8)), "Fortran order"),
        (np.zeros((2, 3, 2), ">u2"), "big-endian"),
    ],
)
def test_read_npy_rejects(array, match):
    buffer = io.BytesIO()
    np.save(buffer, array)
    with pytest.raises(WireFormatError, match=match):
        read_npy(buffer.getvalue())


def test_read_npy_never_unpickles():
    buffer = io.BytesIO()
    np.save(buffer, np.full((1, 1, 1), _Tripwire(), dtype=object), allow_pickle=True)
    with pytest.raises(WireFormatError, match="object"):
        read_npy(buffer.getvalue())
    assert _Tripwire.fired == []


def test_read_npy_rejects_truncation_and_garbage():
    buffer = io.BytesIO()
    np.save(buffer, _routes(4))
    data = buffer.getvalue()
    with pytest.raises(WireFormatError, match=r"expected 32 bytes .* found 31"):
        read_npy(data[:-1])
    with pytest.raises(WireFormatError, match=r"expected a \.npy file"):
        read_npy(b"PK\x03\x04 not numpy")
    # an unclosed header dict: numpy's header filter raises tokenize.TokenError (found by fuzzing)
    with pytest.raises(WireFormatError, match=r"expected a \.npy file"):
        read_npy(b"\x93NUMPY\x01\x00" + struct.pack("<H", 2) + b"{\n")


@SETTINGS
@given(st.data())
def test_fuzz_read_npy_only_raises_r3data_errors(data):
    buffer = io.BytesIO()
    np.save(buffer, _routes(data.draw(st.integers(0, 3))))
    raw = bytearray(buffer.getvalue())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    with contextlib.suppress(R3DataError):
        read_npy(bytes(raw))


# --- all-zero routes and dense layers --------------------------------------------------------


def test_dense_layers_are_found_in_decoded_routes():
    routes = _routes(6, layers=5)
    routes[:, [0, 3]] = 0
    routes[0, 1] = 0  # zero in the first row only: not dense
    assert dense_layers(routes) == (0, 3)
    (rows,) = vllm_routes({"choices": [{"routed_experts": _npy_b64(routes)}]})
    np.testing.assert_array_equal(rows.array, routes)


def test_decoders_report_all_zero_routes_as_they_came():
    """No policy at the wire: the loader's one screen decides (tests/nodes/test_fill.py)."""
    body = {"choices": [{"routed_experts": _npy_b64(np.zeros((4, 3, 2), np.uint8))}]}
    (kept,) = vllm_routes(body)
    assert kept.rows == 4
    assert not kept.array.any()
    raw = orjson.dumps(body)
    (encoded,) = vllm_routes(raw)
    assert isinstance(encoded, EncodedRows)  # left encoded: the loader decodes it in place
    np.testing.assert_array_equal(encoded.array, kept.array)


def test_empty_routes_are_not_zero_routes():
    (rows,) = vllm_routes({"choices": [{"routed_experts": _npy_b64(_routes(0))}]})
    assert rows.rows == 0


# --- SGLang --------------------------------------------------------------------------------


def sglang_item(routes, prompt_tokens=None, completion_tokens=None, start_len=None):
    meta = {"id": "r", "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode()}
    if prompt_tokens is not None:
        meta |= {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    if start_len is not None:
        meta["routed_experts_start_len"] = start_len
    return {"text": "ok", "meta_info": meta}


@pytest.mark.parametrize("raw", [False, True])
def test_sglang_flat_int32(raw):
    routes = _routes(8 + 3 - 1 - 4, layers=5, topk=3, dtype=np.int32)
    body = sglang_item(routes, 8, 3, start_len=4)
    (rows,) = sglang_routes(_http(body) if raw else body, num_layers=5, topk=3)
    np.testing.assert_array_equal(rows.array, routes)
    assert (rows.pos, rows.end, rows.meta["producer"]) == (4, 10, "sglang")


def test_sglang_batch_and_start_argument():
    first, second = _routes(3, seed=1).astype(np.int32), _routes(5, seed=2).astype(np.int32)
    rows = sglang_routes(
        _http([sglang_item(first), sglang_item(second)]), num_layers=4, topk=2, start=2
    )
    assert [(r.pos, r.rows, r.meta["choice"]) for r in rows] == [(2, 3, 0), (2, 5, 1)]
    np.testing.assert_array_equal(rows[1].array, second)


def test_sglang_rejects():
    body = sglang_item(_routes(3).astype(np.int32))
    with pytest.raises(WireFormatError, match=r"multiple of 10 int32 ids \(layers 5 x topk 2\)"):
        sglang_routes(body, num_layers=5, topk=2)
    with pytest.raises(EngineRoutesError, match="expected 4 route rows"):
        sglang_routes(sglang_item(_routes(3).astype(np.int32), 3, 2), num_layers=4, topk=2)
    with pytest.raises(ConfigError, match="num_layers"):
        sglang_routes(body, num_layers=0, topk=2)
    with pytest.raises(WireFormatError, match="meta_info"):
        sglang_routes({"text": "no meta"}, num_layers=4, topk=2)


# --- prime-rl ------------------------------------------------------------------------------


def primerl_choice(routes, prompt_len, completion_len, *, start="anchored", mask=None):
    sidecar = {}
    if start == "anchored":
        sidecar["start"] = prompt_len + completion_len - 1 - routes.shape[0]
    elif start is not None:
        sidecar["start"] = start
    choice = {
        "index": 0,
        "prompt_token_ids": list(range(prompt_len)),
        "token_ids": list(range(completion_len)),
        "routed_experts": pack_ndarray(routes, **sidecar),
    }
    if mask is not None:
        choice["sampling_mask"] = pack_csr(*mask)
    return choice


def test_primerl_routes_are_anchored_at_the_end():
    routes = _routes(6, dtype=np.uint16)
    body = {"choices": [primerl_choice(routes, 5, 4)]}
    (rows,) = primerl_routes(_http(body))
    assert (rows.pos, rows.end) == (2, 8)
    np.testing.assert_array_equal(rows.array, routes)
    body["choices"][0]["routed_experts"]["start"] = 1
    with pytest.raises(
        EngineRoutesError,
        match=r"expected 7 route rows \(prompt 5 \+ completion 4 - 1 - start 1\), found 6",
    ):
        primerl_routes(body)
    too_many = {"choices": [primerl_choice(_routes(9), 5, 4, start=None)]}
    with pytest.raises(EngineRoutesError, match=r"at most 8 route rows \(prompt 5 \+ comp"):
        primerl_routes(too_many)


def test_primerl_routes_placement_sources():
    routes = _routes(3)
    bare = {"choices": [{"routed_experts": pack_ndarray(routes, start=4)}]}
    assert primerl_routes(bare)[0].pos == 4
    assert primerl_routes(bare, prompt_len=6, completion_len=2)[0].pos == 4
    unplaced = {"choices": [{"routed_experts": pack_ndarray(routes)}]}
    with pytest.raises(WireFormatError, match="cannot place the rows"):
        primerl_routes(unplaced)
    assert primerl_routes(unplaced, prompt_len=2, completion_len=5)[0].pos == 3
    handles = {"choices": [{"payload": [{"field": "routed_experts", "file": "v1/a.bin"}]}]}
    with pytest.raises(WireFormatError, match="by handle"):
        primerl_routes(handles)
    float_routes = {"choices": [{"routed_experts": pack_ndarray(routes.astype(np.float32))}]}
    with pytest.raises(WireFormatError, match="float32"):
        primerl_routes(float_routes)


def test_primerl_sampling_mask_rows_start_at_the_first_completion_token():
    ids, counts = [3, 9, 4, 4, 1, 7], [2, 0, 3, 1]
    body = {"choices": [primerl_choice(_routes(7), 4, 4, mask=(ids, counts))]}
    parsed = load_packed_body(_http(body), ("routed_experts", "sampling_mask"))
    (mask,) = primerl_sampling_mask(parsed)
    assert (mask.pos, mask.end, mask.meta["widest"]) == (4, 8, 3)
    np.testing.assert_array_equal(
        mask.array.padded(), [[3, 9, -1], [-1, -1, -1], [4, 4, 1], [7, -1, -1]]
    )
    (routes,) = primerl_routes(parsed)
    assert routes.end == mask.pos + 4 - 1
    with pytest.raises(WireFormatError, match=r"one kept-set size per completion token \(5\)"):
        primerl_sampling_mask(parsed, completion_len=5)
    no_prompt = {"choices": [{"sampling_mask": pack_csr(ids, counts)}]}
    with pytest.raises(WireFormatError, match="without the prompt length"):
        primerl_sampling_mask(no_prompt)
    assert primerl_sampling_mask(no_prompt, prompt_len=10)[0].pos == 10


# --- SkyRL ---------------------------------------------------------------------------------


def test_skyrl_envelopes_wherever_they_are():
    routes = _routes(4, dtype=np.int64)
    envelope = pack_ndarray(routes, start=3, trajectory="t1")
    assert skyrl_routes(envelope)[0].pos == 3
    assert skyrl_routes(_http({"routed_experts": envelope}))[0].meta["sidecar"] == {
        "start": 3,
        "trajectory": "t1",
    }
    listed = skyrl_routes(_http([{"routed_experts": envelope}, pack_ndarray(routes, pos=1)]))
    assert [r.pos for r in listed] == [3, 1]
    choices = skyrl_routes({"choices": [{"routed_experts": pack_ndarray(routes)}]})
    assert choices[0].pos == 0
    assert skyrl_routes(envelope, pos=9)[0].pos == 9
    np.testing.assert_array_equal(choices[0].array, routes)
    with pytest.raises(WireFormatError, match="expected an envelope"):
        skyrl_routes({"other": 1})


# --- every producer round-trips --------------------------------------------------------------


def _encode(producer: str, routes: np.ndarray, start: int):
    if producer == "vllm":
        body = {"choices": [{"routed_experts": _npy_b64(routes)}]}
        return vllm_routes(_http(body), prompt_start=start)
    if producer == "sglang":
        body = sglang_item(routes.astype(np.int32), start_len=start)
        return sglang_routes(_http(body), num_layers=routes.shape[1], topk=routes.shape[2])
    if producer == "prime-rl":
        body = {"choices": [primerl_choice(routes, start + 1, routes.shape[0])]}
        return primerl_routes(_http(body))
    return skyrl_routes(_http({"routed_experts": pack_ndarray(routes, start=start)}))


@SETTINGS
@given(
    st.sampled_from(["vllm", "sglang", "prime-rl", "skyrl"]),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(2, 3),
    st.sampled_from([np.uint8, np.uint16]),
    st.integers(0, 5),
)
def test_every_producer_round_trips(producer, rows, layers, topk, dtype, start):
    routes = _routes(rows, layers, topk, dtype)
    (got,) = _encode(producer, routes, start)
    np.testing.assert_array_equal(got.array, routes)
    assert (got.pos, got.rows) == (start, rows)
