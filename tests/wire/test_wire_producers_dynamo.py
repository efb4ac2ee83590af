"""The ``dynamo-vllm`` format: bodies built as Dynamo's vLLM worker and OpenAI frontend build
them (tests/wire/producer_bodies/dynamo_000a36a7/generate.py) decode to the rows the worker
was given, at their positions; what Dynamo does not send, or sends unattributably, is refused
with a typed error."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from r3data.errors import EngineRoutesError, WireFormatError
from r3data.wire import EncodedRows, load_packed_body
from r3data.wire.producers import FORMATS, Lengths, detect

BODIES = Path(__file__).parent / "producer_bodies" / "dynamo_000a36a7"
EXPECTED = json.loads((BODIES / "expected.json").read_text())
DYNAMO = FORMATS["dynamo-vllm"]
OPTIONS = DYNAMO.make_options({})


def _decode(body, lengths: Lengths | None = None):
    return DYNAMO.decode(body, OPTIONS, lengths or Lengths())


@pytest.mark.parametrize("case", sorted(c for c in EXPECTED if not EXPECTED[c]["refused"]))
def test_dynamo_bodies_decode_to_what_the_worker_was_given(case):
    raw = (BODIES / f"{case}.body").read_bytes()
    expected = EXPECTED[case]["choices"]
    assert [f.name for f in detect(raw)] == ["dynamo-vllm"]
    stream = raw.startswith(b"data:")
    spliced = None if stream else load_packed_body(raw, DYNAMO.spliced)  # blobs decoded
    for body in [raw] if stream else [raw, spliced, orjson.loads(raw)]:
        choices = _decode(body)
        assert len(choices) == len(expected)
        for choice, want in zip(choices, expected, strict=True):
            ((routes,),) = [choice.sources]
            array = np.asarray(want["rows"], want["dtype"]).reshape(-1, 4, 2)
            assert routes.pos == want["start"]
            assert routes.array.dtype == array.dtype
            np.testing.assert_array_equal(routes.array, array)
            assert isinstance(routes, EncodedRows) == (body is not spliced)  # still base64
            if len(expected) == 1:  # the lengths came from the body
                assert (routes.meta["prompt_len"], routes.meta["completion_len"]) == (
                    want["P"],
                    want["C"],
                )


def test_the_stream_routes_each_choice_it_names():
    """n = 2 streamed: each finishing chunk names its choice; with the request's lengths the
    row counts are checked per choice (the second is 2 tokens longer)."""
    raw = (BODIES / "chat_stream_n2.body").read_bytes()
    _, second = EXPECTED["chat_stream_n2"]["choices"]
    (one,) = DYNAMO.decode(raw, DYNAMO.make_options({"choice": 1}), Lengths(5, second["C"]))
    np.testing.assert_array_equal(one.sources[0].array, np.asarray(second["rows"], np.uint8))
    with pytest.raises(EngineRoutesError, match=r"expected 7 route rows .*, found 5"):
        DYNAMO.decode(raw, DYNAMO.make_options({"choice": 0}), Lengths(5, 5))


def test_several_choices_merged_into_one_nvext_are_refused():
    raw = (BODIES / "chat_n2_merged.body").read_bytes()
    assert [f.name for f in detect(raw)] == ["dynamo-vllm"]
    for body in (raw, orjson.loads(raw)):
        with pytest.raises(
            WireFormatError, match=r"expected a response of one choice, found 2; Dynamo merges"
        ):
            _decode(body)


def _body(envelope: object = None, *, usage=(4, 3), **nvext) -> dict:
    if envelope is not None:
        nvext["routed_experts"] = envelope
    return {
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
        "object": "chat.completion",
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
        "nvext": nvext,
    }


def _envelope(rows: int = 6, *, start: int = 0, dtype: str = "uint8", **override) -> dict:
    data = base64.b64encode(np.arange(rows * 8, dtype=dtype).tobytes()).decode()
    return {"data": data, "dtype": dtype, "shape": [rows, 4, 2], "start": start, **override}


def test_the_rows_start_where_the_envelope_says_and_counts_are_checked():
    ((rows,),) = [_decode(_body(_envelope(4, start=2)))[0].sources]
    assert (rows.pos, rows.rows) == (2, 4)
    with pytest.raises(
        EngineRoutesError, match=r"expected 6 route rows \(prompt 4 \+ completion 3"
    ):
        _decode(_body(_envelope(5)))
    with pytest.raises(WireFormatError, match="the response has 4 prompt tokens, the request 5"):
        _decode(_body(_envelope()), Lengths(5, 3))
    with pytest.raises(WireFormatError, match=r"usage.completion_tokens is 3 but .* holds 2 ids"):
        _decode(_body(_envelope(), completion_token_ids=[1, 2]))


@pytest.mark.parametrize(
    ("envelope", "match"),
    [
        # Dynamo before PR #10529: base85 {data, shape}, neither start nor dtype
        ({"data": base64.b85encode(b"\0" * 48).decode(), "shape": [6, 4, 2]}, "base85"),
        # the SGLang worker's: SGLang's bare base64 of flat int32 ids, no shape
        ("AAAAAAAAAAA=", r"expected \{data, shape, start, dtype\} .*, found str"),
        (_envelope(dtype="float32"), "float32"),
        (_envelope(shape=[48]), "shape"),
        (_envelope(start=-1), "start"),
    ],
)
def test_envelopes_dynamo_does_not_send_are_refused(envelope, match):
    with pytest.raises(WireFormatError, match=match):
        _decode(_body(envelope))
    with pytest.raises(WireFormatError):  # spliced from the raw body, refused as well
        _decode(orjson.dumps(_body(envelope)))


def test_a_shape_claim_is_checked_against_the_blob_before_anything_is_sized_by_it():
    huge = _envelope(shape=[1 << 40, 4, 2])
    with pytest.raises(EngineRoutesError, match="found 1099511627776"):  # usage: 6 rows
        _decode(_body(huge))
    for body in (_body(huge, usage=(None, None)), orjson.dumps(_body(huge, usage=(None, None)))):
        with pytest.raises(
            WireFormatError, match=r"expected 8796093022208 bytes .*, found 48 decoded"
        ):
            _decode(body)


def test_a_response_without_routes_has_none_and_a_broken_nvext_is_refused():
    (choice,) = _decode(_body(worker_id={"decode_worker_id": 1}))
    assert (choice.sources, choice.missing) == (
        (),
        ("dynamo-vllm choices[0] nvext.routed_experts",),
    )
    assert detect(orjson.dumps(_body(worker_id={}))) == []
    with pytest.raises(WireFormatError, match="expected 'nvext' to be an object, found list"):
        _decode({**_body(), "nvext": []})


def _stream(*chunks: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _chunk(index: int, finish: str | None, envelope: object = None, *, more: int = 0) -> dict:
    choices = [{"index": index, "delta": {"content": "x"}, "finish_reason": finish}]
    choices += [{"index": index + 1 + i, "delta": {}, "finish_reason": None} for i in range(more)]
    chunk = {"choices": choices, "object": "chat.completion.chunk"}
    return chunk | ({"nvext": {"routed_experts": envelope}} if envelope is not None else {})


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_stream(_chunk(0, None, _envelope()), _chunk(0, "length")), "before it finished"),
        (_stream(_chunk(0, "length", _envelope()), _chunk(0, "length", _envelope())), "again"),
        (_stream(_chunk(0, "length", _envelope(), more=1)), "a chunk of one choice"),
        (_stream(_chunk(0, None), _chunk(2, "length", _envelope())), r"indices 0..n-1"),
    ],
)
def test_streams_dynamo_does_not_send_are_refused(raw, match):
    with pytest.raises(WireFormatError, match=match):
        _decode(raw)


def test_the_loader_reads_a_dynamo_source():
    import r3data

    raw = (BODIES / "chat_uint8.body").read_bytes()
    (want,) = EXPECTED["chat_uint8"]["choices"]
    P, C = want["P"], want["C"]
    source = {"producer": "dynamo-vllm", "response": raw}
    request = {"prompt_len": P, "completion_len": C, "sources": [source]}
    sample = {"id": "s", "token_ids": np.arange(P + C), "requests": [request]}
    (batch,) = r3data.loader([sample], batch_size=1, num_experts=8)
    routes = batch["routed_experts"].values.numpy()
    np.testing.assert_array_equal(routes[: P + C - 1], np.asarray(want["rows"]))
    assert batch["routed_experts_valid"].values.numpy().tolist() == [True] * (P + C - 1) + [False]


def test_an_envelope_without_a_start_is_refused_not_read_from_position_0():
    """The worker always sends ``int(start)``: a null start would place the rows at 0 (with
    the lengths unknown nothing else checks it)."""
    body = _body(_envelope(start=None), usage=(None, None))
    for raw in (body, orjson.dumps(body), load_packed_body(orjson.dumps(body), DYNAMO.spliced)):
        with pytest.raises(WireFormatError, match=r"routed_experts.start: expected an int >= 0"):
            _decode(raw)


def test_routes_under_both_nvext_keys_must_be_the_same_envelope():
    """The frontend copies one ``engine_data.routed_experts`` into ``nvext.routed_experts``:
    two that differ are not Dynamo's, and either could be the wrong rows."""
    same = _body(_envelope(), engine_data={"routed_experts": _envelope(), "x": 1})
    raw = orjson.dumps(same)
    for body in (same, raw, load_packed_body(raw, DYNAMO.spliced)):
        ((rows,),) = [_decode(body)[0].sources]
        assert (rows.pos, rows.rows) == (0, 6)
    other = np.full(48, 7, np.uint8)
    moved = _envelope(5, start=1)  # the same rows count for the lengths, a different start
    differ = [
        _envelope() | {"data": base64.b64encode(other.tobytes()).decode()},
        moved,
        _envelope(dtype="uint16", rows=3) | {"shape": [6, 4, 1]},
    ]
    for theirs in differ:
        body = _body(_envelope(), engine_data={"routed_experts": theirs})
        raw = orjson.dumps(body)
        for doc in (body, raw, load_packed_body(raw, DYNAMO.spliced)):
            with pytest.raises(WireFormatError, match=r"engine_data.routed_experts differs"):
                _decode(doc)
    both = {"routed_experts": _envelope(), "engine_data": {"routed_experts": moved}}
    stream = _stream(_chunk(0, "length") | {"nvext": both})
    with pytest.raises(WireFormatError, match=r"engine_data.routed_experts differs"):
        _decode(stream)


def test_the_sglang_workers_string_is_named_a_string_from_a_raw_body_too():
    raw = orjson.dumps(_body("AAAAAAAAAAA="))
    with pytest.raises(WireFormatError, match=r"dtype\} .*, found str;"):
        _decode(raw)
