"""Producer formats: the decoders' entry points (vLLM, SGLang, prime-rl, SkyRL), the `.npy`
header, and the registry: every format decodes what it encodes, options are typed."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
from pathlib import Path
from typing import ClassVar

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import (
    ConfigError,
    EngineRoutesError,
    R3DataError,
    SegmentError,
    WireFormatError,
)
from r3data.nodes.screen import dense_layers
from r3data.ragged import RaggedRows
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
from r3data.wire.producers import FORMATS, EngineRequest, Lengths, detect, producer_format
from r3data.wire.producers.base import ProducerFormat

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


def test_vllm_prompt_start_is_the_callers():
    """vLLM does not echo routed_experts_prompt_start: the caller says it, the lengths check it."""
    array = _routes(10 + 4 - 1 - 6)
    body = vllm_response([array], 10, [4])
    (rows,) = vllm_routes(_http(body), prompt_start=6)
    assert (rows.pos, rows.end) == (6, 13)
    with pytest.raises(EngineRoutesError, match=r"expected 13 route rows .* found 7"):
        vllm_routes(body)


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
    with pytest.raises(WireFormatError, match=r"vllm choices\[1\].routed_experts: no rows \(null"):
        vllm_routes(body)
    with pytest.raises(ConfigError, match="choice 2 out of range"):
        vllm_routes(body, choice=2)
    with pytest.raises(WireFormatError, match="'choices' list"):
        vllm_routes({"data": []})
    with pytest.raises(ConfigError, match="start: expected an int >= 0, found -1"):
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


def sglang_item(routes, prompt_tokens=None, completion_tokens=None):
    meta = {"id": "r", "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode()}
    if prompt_tokens is not None:
        meta |= {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"text": "ok", "meta_info": meta}


@pytest.mark.parametrize("raw", [False, True])
def test_sglang_flat_int32(raw):
    routes = _routes(8 + 3 - 1 - 4, layers=5, topk=3, dtype=np.int32)
    body = sglang_item(routes, 8, 3)
    (rows,) = sglang_routes(_http(body) if raw else body, num_layers=5, topk=3, start=4)
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


def primerl_choice(routes, completion_len, *, start=0, mask=None):
    """A prime-rl choice: no prompt ids (the prompt length is the request's)."""
    choice = {
        "index": 0,
        "token_ids": list(range(completion_len)),
        "routed_experts": pack_ndarray(routes, start=start),
    }
    if mask is not None:
        choice["sampling_mask"] = pack_csr(*mask)
    return choice


def test_primerl_routes_start_at_start_and_end_at_the_last_forwarded_token():
    routes = _routes(6, dtype=np.uint16)
    body = {"choices": [primerl_choice(routes, 4, start=2)]}
    (rows,) = primerl_routes(_http(body), prompt_len=5)
    assert (rows.pos, rows.end) == (2, 8)
    np.testing.assert_array_equal(rows.array, routes)
    body["choices"][0]["routed_experts"]["start"] = 1
    with pytest.raises(
        EngineRoutesError,
        match=r"expected 7 route rows \(prompt 5 \+ completion 4 - 1 - start 1\), found 6",
    ):
        primerl_routes(body, prompt_len=5)
    assert primerl_routes(body)[0].pos == 1  # without the prompt length: the start places them


@pytest.mark.parametrize("shape", [[1, 0, 2], [1, 2, 0], [0, 0, 0]])
def test_primerl_envelopes_with_an_empty_layer_or_topk_axis_are_refused(shape):
    body = {"choices": [{"token_ids": [7], "routed_experts": {"data": "", "shape": shape}}]}
    with pytest.raises(WireFormatError, match=r"layers > 0, topk > 0"):
        primerl_routes(_http(body))


def test_primerl_routes_without_start_or_dtype_and_by_handle():
    routes = _routes(3)
    envelope = pack_ndarray(routes)
    del envelope["dtype"]  # before 6b1604380: uint8; no start before ae748fd69: rows from 0
    (rows,) = primerl_routes(
        _http({"choices": [{"routed_experts": envelope}]}), prompt_len=2, completion_len=2
    )
    assert (rows.pos, rows.dtype) == (0, np.uint8)
    np.testing.assert_array_equal(rows.array, routes)
    handles = {"choices": [{"payload": [{"field": "routed_experts", "file": "v1/a.bin"}]}]}
    with pytest.raises(
        SegmentError, match=r"prime-rl choices\[0\].payload\[0\]: segment must have"
    ):
        primerl_routes(handles)
    handles["choices"][0]["payload"][0] |= {
        "offset": 0,
        "pos": 0,
        "rows": 3,
        "dtype": "uint8",
        "shape": [4, 2],
    }
    with pytest.raises(WireFormatError, match="by handle"):
        primerl_routes(handles)
    float_routes = {"choices": [{"routed_experts": pack_ndarray(routes.astype(np.float32))}]}
    with pytest.raises(WireFormatError, match="float32"):
        primerl_routes(float_routes)


def test_primerl_sampling_mask_rows_start_at_the_first_completion_token():
    ids, counts = [3, 9, 4, 4, 1, 7], [2, 0, 3, 1]
    body = {"choices": [primerl_choice(_routes(7), 4, mask=(ids, counts))]}
    parsed = load_packed_body(_http(body), ("routed_experts", "sampling_mask"))
    (mask,) = primerl_sampling_mask(parsed, prompt_len=4)
    assert (mask.pos, mask.end, mask.array.widest) == (4, 8, 3)
    np.testing.assert_array_equal(
        mask.array.padded(), [[3, 9, -1], [-1, -1, -1], [4, 4, 1], [7, -1, -1]]
    )
    (routes,) = primerl_routes(parsed, prompt_len=4)
    assert routes.end == mask.pos + 4 - 1
    with pytest.raises(
        WireFormatError, match=r"the response has 4 completion tokens, the request 5"
    ):
        primerl_sampling_mask(parsed, prompt_len=4, completion_len=5)
    no_prompt = {"choices": [{"sampling_mask": pack_csr(ids, counts)}]}
    with pytest.raises(WireFormatError, match="without the prompt length"):
        primerl_sampling_mask(no_prompt)
    assert primerl_sampling_mask(no_prompt, prompt_len=10)[0].pos == 10


# --- SkyRL ---------------------------------------------------------------------------------


def test_skyrl_envelopes_start_at_the_callers_position():
    routes = _routes(4, dtype=np.int16)
    body = {"choices": [{"token_ids": [1, 2], "routed_experts": pack_ndarray(routes)}]}
    assert skyrl_routes(body)[0].pos == 0
    (rows,) = skyrl_routes(_http(body), pos=3)
    assert (rows.pos, rows.dtype) == (3, np.int16)
    np.testing.assert_array_equal(rows.array, routes)
    with pytest.raises(WireFormatError, match="'choices' list"):
        skyrl_routes({"other": 1})


def test_skyrl_lengths_catch_a_later_turn_read_without_its_start():
    """A later turn's rows (its request sent a start the body does not echo) read without the
    start would sit at 0; the request's lengths refuse them instead."""
    routes = _routes(4, dtype=np.uint8)  # a turn of prompt 5 + completion 2 from start 2
    body = {"choices": [{"token_ids": [1, 2], "routed_experts": pack_ndarray(routes)}]}
    (rows,) = skyrl_routes(body, pos=2, prompt_len=5, completion_len=2)
    assert (rows.pos, rows.rows) == (2, 4)
    with pytest.raises(EngineRoutesError, match=r"expected 6 route rows .* found 4"):
        skyrl_routes(body, prompt_len=5, completion_len=2)


@pytest.mark.parametrize("name", ["skyrl", "skyrl-v1"])
def test_skyrl_zero_rows_place_nothing(name):
    """A request from its last position gets no rows; the nested-list form sends ``[]``, which
    keeps no row shape, so no source is placed (rather than one of the wrong shape)."""
    entry = FORMATS[name]
    request = EngineRequest([1, 2], [3], np.zeros((0, 4, 2), np.uint8), start=2)
    body = entry.encode(request)
    (choice,) = entry.decode(body, entry.make_options({"start": 2}), Lengths(2, 1))
    assert [s for s in choice.sources if s.field == "routed_experts"] == []


# --- the registry: every format encodes what it decodes; options are typed ----------------------


def _engine(rng, rows: int, experts: int) -> np.ndarray:
    """A router's picks: distinct experts per MoE layer, dense layer 0 all zero."""
    picks = np.argsort(rng.random((rows, 4, experts)), axis=-1)[..., :2]
    picks[:, 0] = 0
    return picks


ROUTE_FORMATS = sorted(name for name, f in FORMATS.items() if "routed_experts" in f.fields)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(ROUTE_FORMATS),
    st.integers(1, 6),
    st.integers(1, 5),
    st.sampled_from([8, 300]),
    st.data(),
)
def test_every_format_decodes_what_it_encodes(name, prompt_len, completion_len, experts, data):
    entry = FORMATS[name]
    start = data.draw(st.integers(0, prompt_len)) if entry.prompt_start else 0
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    full = _engine(rng, prompt_len + completion_len - 1, experts)
    request = EngineRequest(
        list(range(prompt_len)),
        list(range(completion_len)),
        full[start:],
        start=start,
        num_experts=experts,
        moe_layers=(1, 2, 3),
        sampling_mask=RaggedRows.from_rows([[i] * (i % 3) for i in range(completion_len)]),
    )
    body = entry.encode(request)
    assert name in [f.name for f in detect(body)]
    options = entry.make_options(entry.request_options(request))
    (choice,) = entry.decode(body, options, Lengths(prompt_len, completion_len))
    routes = [s for s in choice.sources if s.field == "routed_experts"]
    want = full[:, 1:] if entry.layer_axis == "moe" else full
    got = np.concatenate([r.array for r in routes]) if routes else np.zeros((0, *want.shape[1:]))
    assert routes[0].pos == start if routes else start == prompt_len + completion_len - 1
    np.testing.assert_array_equal(got, want[start:])
    assert {r.meta["layer_axis"] for r in routes} <= {entry.layer_axis}
    for side in (s for s in choice.sources if s.field != "routed_experts"):
        assert (side.pos, side.array) == (prompt_len, request.sampling_mask)


def test_the_masks_only_format_encodes_masks():
    entry = FORMATS["prime-rl-sampling-mask"]
    mask = RaggedRows.from_rows([[4, 5], [], [6]])
    request = EngineRequest([1, 2], [3, 4, 5], np.ones((4, 2, 2), np.uint8), sampling_mask=mask)
    body = entry.encode(request)
    assert [f.name for f in detect(body)] == ["prime-rl-sampling-mask"]
    (choice,) = entry.decode(body, entry.make_options({}), Lengths(2, 3))
    ((rows,),) = [choice.sources]
    assert (rows.field, rows.pos, rows.array) == ("sampling_mask", 2, mask)


def test_options_are_typed_and_misspellings_name_the_valid_ones():
    sglang = FORMATS["sglang"]
    assert sglang.make_options({"num_layers": 4, "topk": 2, "start": 3}).start == 3
    with pytest.raises(
        ConfigError,
        match=r"producer 'sglang' options: unknown option 'stat' \(did you mean 'start'\?\); "
        r"valid options: choice, num_layers, role, start, topk",
    ):
        sglang.make_options({"num_layers": 4, "topk": 2, "stat": 3})
    with pytest.raises(ConfigError, match=r"options: missing 'num_layers', 'topk'; valid options"):
        sglang.make_options({})
    assert FORMATS["vllm"].make_options({"start": 1}).start == 1  # cached: True is not 1
    for bad, match in [
        ({"choice": -1}, "choice: expected an int >= 0"),
        ({"start": "3"}, "start: expected an int >= 0, found '3'"),
        ({"role": "prefil"}, r"role: expected one of \['full', 'prefill', 'decode'\]"),
        ({"start": True}, "start: expected an int"),
    ]:
        with pytest.raises(ConfigError, match=match):
            FORMATS["vllm"].make_options(bad)
    with pytest.raises(ConfigError, match=r"topk: expected an int >= 1, found 0"):
        sglang.make_options({"num_layers": 4, "topk": 0})
    with pytest.raises(ConfigError, match=r"producer: expected one of \[.*\], found 'vlm'"):
        producer_format("vlm")


def test_a_format_without_a_prompt_start_serves_every_row():
    request = EngineRequest([1, 2, 3], [4], np.ones((2, 2, 2), np.uint8), start=1)
    for name in ("nemo-rl", "sglang-0.5.7", "vllm-0.21", "sglang-openai-0.5.9"):
        with pytest.raises(ConfigError, match="returns rows from position 0"):
            FORMATS[name].encode(request)
    with pytest.raises(
        ConfigError,
        match=r"expected 2 route rows \(prompt 3 \+ completion 1 - 1 - start 1\), found 4",
    ):
        EngineRequest([1, 2, 3], [4], np.ones((4, 2, 2), np.uint8), start=1)


def test_docs_list_every_format():
    text = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    for name in FORMATS:
        assert f"`{name}`" in text, name


STREAMING = (
    "vllm",
    "sglang",
    "sglang-0.5.7",
    "sglang-openai",
    "sglang-openai-0.5.9",
    "dynamo-vllm",
)
SSE_BODY = b'data: {"choices": []}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("name", STREAMING)
def test_streaming_formats_state_only_their_assembler(name: str) -> None:
    """A streaming format names its stream assembler; the base parse dispatches to it."""
    entry = FORMATS[name]
    assert type(entry).parse is ProducerFormat.parse
    assert entry.stream_assembler is not None


def test_parse_hands_only_a_stream_to_the_assembler() -> None:
    """``parse``: a server-sent-event body goes to ``stream_assembler`` (named '<name>
    stream'); any other body, or any body of a format with no assembler, is parsed plainly."""
    calls: list[tuple[bytes, str]] = []

    def assemble(raw: bytes, what: str) -> dict[str, str]:
        calls.append((raw, what))
        return {"assembled": what}

    class Streaming(ProducerFormat):
        name = "streaming-test"
        spliced = ("routed_experts",)
        stream_assembler = staticmethod(assemble)

    class Plain(ProducerFormat):
        name = "plain-test"
        spliced = ("routed_experts",)

    assert Streaming().parse(SSE_BODY) == {"assembled": "streaming-test stream"}
    assert calls == [(SSE_BODY, "streaming-test stream")]
    assert Streaming().parse(b'{"a": 1}') == {"a": 1}
    assert len(calls) == 1
    with pytest.raises(WireFormatError, match="invalid JSON near byte 0"):
        Plain().parse(SSE_BODY)
