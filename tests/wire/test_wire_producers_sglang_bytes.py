"""Bodies written by SGLang 0.5.23's own serializer (its OpenAI pydantic models and
``dumps_json``; tests/wire/producer_bodies/sglang_0_5_23/generate.py) decode to the rows,
positions and masks SGLang was given, each on the choice SGLang meant."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from r3data.wire.producers import FORMATS, Lengths, detect

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
