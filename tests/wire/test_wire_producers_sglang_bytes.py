"""Bodies written by SGLang 0.5.23's own serializer (its OpenAI pydantic models and
``dumps_json``; tests/wire/producer_bodies/sglang_0_5_23/generate.py) decode to the rows,
positions and masks SGLang was given, each on the choice SGLang meant."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from r3data.errors import WireFormatError
from r3data.wire.producers import FORMATS, Lengths, detect
from r3data.wire.producers.sglang import flat_int32_base64

BODIES = Path(__file__).parent / "producer_bodies" / "sglang_0_5_23"
EXPECTED = json.loads((BODIES / "expected.json").read_text())


def _ragged(rows) -> list[list[int]]:
    return [rows.values[a:b].tolist() for a, b in itertools.pairwise(rows.offsets)]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_sglang_serialized_bodies_decode_to_what_sglang_was_given(case):
    raw = (BODIES / f"{case}.body").read_bytes()
    name = "sglang" if case.startswith("generate") else "sglang-openai"
    assert next(f.name for f in detect(raw)) == name
    entry = FORMATS[name]
    start = EXPECTED[case]["start"]
    options = entry.make_options({"num_layers": 4, "topk": 2, "start": start})
    lengths = Lengths(*EXPECTED[case].get("request", (None, None)))
    choices = entry.decode(raw, options, lengths)
    expected = EXPECTED[case]["choices"]
    assert len(choices) == len(expected)
    for choice, want in zip(choices, expected, strict=True):
        fields = {s.field: s for s in choice.sources}
        if want["rows"] is None:
            assert "routed_experts" not in fields
            assert choice.missing
        else:
            routes = fields["routed_experts"]
            assert routes.pos == start
            np.testing.assert_array_equal(routes.array, np.asarray(want["rows"], np.int32))
        if want["mask"] is None:
            assert "sampling_mask" not in fields
        else:
            assert fields["sampling_mask"].pos == want["P"]
            assert _ragged(fields["sampling_mask"].array) == want["mask"]


def _sglang(case: str, name: str, request: tuple[int, int], start: int):
    raw = (BODIES / f"{case}.body").read_bytes()
    entry = FORMATS[name]
    options = entry.make_options({"num_layers": 4, "topk": 2, "start": start})
    return entry.decode(raw, options, Lengths(*request))


def test_only_kimi_k3s_stub_is_taken_out_of_a_chat_prompt_count():
    """A chat count 3 short of the request's is Kimi-K3's stub; 4 short, or a completions
    count 3 short (SGLang's completions report the model input), is another response's."""
    with pytest.raises(WireFormatError, match="4 prompt tokens, the request 8"):
        _sglang("chat_kimi_k3_sglext", "sglang-openai", (8, 3), 2)
    with pytest.raises(WireFormatError, match="4 prompt tokens, the request 7"):
        _sglang("completions_sglext", "sglang-openai", (7, 2), 0)


def test_incremental_mask_rows_must_follow_the_earlier_chunks():
    """A delta that does not start where the item's earlier rows end (a chunk lost) is
    refused, naming the counts."""
    raw = (BODIES / "generate_stream_incremental_mask.body").read_bytes()
    events = raw.split(b"\n\n")
    lost = b"\n\n".join(events[:1] + events[2:])  # the second chunk (rows 1-2) is gone
    entry = FORMATS["sglang"]
    options = entry.make_options({"num_layers": 4, "topk": 2})
    with pytest.raises(WireFormatError, match=r"1 output_token_sampling_mask rows of 4 .*follow 1"):
        entry.decode(lost, options)


def test_an_incremental_mask_missing_from_the_last_chunk_is_refused():
    """Rows the earlier chunks sent are never dropped because the final chunk left its mask out
    (read as no mask at all, the item's sampling mask was silently lost)."""
    events = (BODIES / "generate_stream_incremental_mask.body").read_bytes().split(b"\n\n")
    events = [e for e in events if e.strip() and e.strip() != b"data: [DONE]"]
    chunk = json.loads(events[-1].removeprefix(b"data: "))
    del chunk["meta_info"]["output_token_sampling_mask"]
    events[-1] = b"data: " + json.dumps(chunk).encode()
    entry = FORMATS["sglang"]
    options = entry.make_options({"num_layers": 4, "topk": 2})
    with pytest.raises(WireFormatError, match=r"last chunk .* no output_token_sampling_mask"):
        entry.decode(b"\n\n".join(events) + b"\n\n", options)


def _other_chat(routes_rows: int | None) -> bytes:
    """The Kimi-K3 meta_info chat body as another model's response would be: a prompt of 4
    (3 short of the request's 7) whose routes cover that prompt (or no routes)."""
    body = json.loads((BODIES / "chat_kimi_k3_meta_info.body").read_bytes())
    meta = body["choices"][0]["meta_info"]
    if routes_rows is None:
        del meta["routed_experts"]
    else:
        meta["routed_experts"] = flat_int32_base64(np.zeros((routes_rows, 4, 2), np.int32))
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "fields", [None, frozenset({"sampling_mask"})], ids=["every field", "mask alone"]
)
@pytest.mark.parametrize(
    ("routes_rows", "message"),
    [
        (4, r"4 prompt tokens, the request 7 \(Kimi-K3.*expected 7 rows .*found 128 bytes"),
        (None, r"4 prompt tokens, the request 7; is this the request's response"),
    ],
    ids=["own routes", "no routes"],
)
def test_a_chat_prompt_3_short_whose_routes_do_not_cover_the_stub_is_another_response(
    fields, routes_rows, message
):
    """The Kimi-K3 reading holds only where the routes cover the whole input: a chat response
    whose prompt is 3 short and whose routes cover that prompt (4 + 3 - 1 - start 2 rows), or
    that has none, is another request's, refused whichever fields are decoded (its mask was
    placed 3 positions late, and with routes the refusal named only their row count)."""
    entry = FORMATS["sglang-openai"]
    options = entry.make_options({"num_layers": 4, "topk": 2, "start": 2})
    with pytest.raises(WireFormatError, match=message):
        entry.decode(_other_chat(routes_rows), options, Lengths(7, 3), fields)


def test_a_chat_prompt_3_short_is_not_taken_for_the_stub_without_a_completion_count():
    """With no completion count (none in usage, none in the request) the routes' size cannot
    tell the stub from a shorter prompt: the count was taken as the request's, and then no row
    count was checked at all (another request's 4 rows were placed from the start)."""
    body = json.loads((BODIES / "chat_kimi_k3_sglext.body").read_bytes())
    del body["usage"]["completion_tokens"]
    body["sglext"]["routed_experts"] = flat_int32_base64(np.zeros((4, 4, 2), np.int32))
    entry = FORMATS["sglang-openai"]
    options = entry.make_options({"num_layers": 4, "topk": 2, "start": 2})
    with pytest.raises(WireFormatError, match="4 prompt tokens, the request 7; is this"):
        entry.decode(json.dumps(body).encode(), options, Lengths(7, None))
