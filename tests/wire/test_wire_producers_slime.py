"""slime's patched SGLang: its top-p masks (kept ids + offsets) become ``sampling_mask`` rows at
``prompt + i``; bodies are built the way slime's patch builds them (``array("i")`` through
pybase64, offsets from 0), and a body the ``sglang`` format would drop masks from is refused."""

from __future__ import annotations

from array import array

import numpy as np
import orjson
import pybase64
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import WireFormatError
from r3data.wire.producers import FORMATS, Lengths, detect

LAYERS, TOPK = 2, 2


def int32_base64(values: list[int]) -> str:
    """slime's ``_b64_encode_int32``: the values as C ints, base64."""
    return pybase64.b64encode(array("i", values).tobytes()).decode()


def slime_meta_info(
    prompt: int, kept: list[list[int]], names=("top_p_token_ids", "top_p_token_offsets")
) -> dict:
    """A finished request's ``meta_info`` as slime's patched tokenizer manager writes it."""
    ids: list[int] = []
    offsets = [0]
    for row in kept:
        ids.extend(int(i) for i in row)
        offsets.append(len(ids))
    routes = np.arange((prompt + len(kept) - 1) * LAYERS * TOPK) % 7
    return {
        "id": "r",
        "finish_reason": {"type": "length", "length": len(kept)},
        "prompt_tokens": prompt,
        "completion_tokens": len(kept),
        "routed_experts": int32_base64(routes.tolist()),
        names[0]: int32_base64(ids),
        names[1]: int32_base64(offsets),
    }


def body(*metas: dict) -> bytes:
    items = [
        {"text": "", "output_ids": [1] * m["completion_tokens"], "meta_info": m} for m in metas
    ]
    return orjson.dumps(items if len(items) > 1 else items[0])


def decode(name: str, raw: bytes, lengths: Lengths | None = None, fields=None):
    entry = FORMATS[name]
    options = entry.make_options({"num_layers": LAYERS, "topk": TOPK})
    return entry.decode(raw, options, lengths or Lengths(None, None), fields)


def masks(choice) -> tuple[list[list[int]], int]:
    (mask,) = [s for s in choice.sources if s.field == "sampling_mask"]
    values, offsets = mask.array.compact()
    return [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)], mask.pos


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=5), min_size=1, max_size=8),
    st.booleans(),
)
def test_slime_masks_land_at_each_output_token(prompt, kept, legacy_names):
    names = ("top_p_kept_token_ids", "top_p_kept_token_offsets") if legacy_names else None
    meta = slime_meta_info(prompt, kept, names) if names else slime_meta_info(prompt, kept)
    raw = body(meta)
    assert "slime" in [f.name for f in detect(raw)]
    (choice,) = decode("slime", raw)
    assert masks(choice) == (kept, prompt)  # an empty row: no mask there
    (routes,) = [s for s in choice.sources if s.field == "routed_experts"]
    assert (routes.pos, routes.rows) == (0, prompt + len(kept) - 1)


def test_each_item_of_a_batch_keeps_its_own_masks():
    raw = body(slime_meta_info(3, [[5], [6, 7]]), slime_meta_info(2, [[], [9], [1, 2, 3]]))
    first, second = decode("slime", raw)
    assert masks(first) == ([[5], [6, 7]], 3)
    assert masks(second) == ([[], [9], [1, 2, 3]], 2)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 2, 3], r"expected offsets from 0 to the 3 ids, found first and last \[1, 3\]"),
        ([0, 2, 4], r"offsets from 0 to the 3 ids, found first and last \[0, 4\]"),
        ([0, 2, 1, 3], r"never decrease, found 2 then 1 at token 1"),
        ([0, 3], r"one offset per completion token \(3\) and one more, found 2"),
        ([], r"found first and last none"),
    ],
)
def test_offsets_that_do_not_describe_the_tokens_are_refused(offsets, message):
    meta = slime_meta_info(2, [[1], [2], [3]])
    meta["top_p_token_offsets"] = int32_base64(offsets)
    with pytest.raises(WireFormatError, match=message):
        decode("slime", body(meta), Lengths(2, 3))


def test_ids_without_offsets_are_refused():
    meta = slime_meta_info(2, [[1], [2]])
    del meta["top_p_token_offsets"]
    with pytest.raises(WireFormatError, match="top_p_token_offsets"):
        decode("slime", body(meta))


def test_sglang_refuses_to_drop_slime_masks_and_reads_its_routes():
    raw = body(slime_meta_info(3, [[5], [6, 7]]))
    with pytest.raises(
        WireFormatError, match=r"slime's top-p masks .*the 'slime' format reads them"
    ):
        decode("sglang", raw)
    (choice,) = decode("sglang", raw, fields=frozenset({"routed_experts"}))
    assert [s.field for s in choice.sources] == ["routed_experts"]


def test_one_mask_only():
    meta = slime_meta_info(2, [[1], [2]])
    meta["output_token_sampling_mask"] = [[1], [2]]
    with pytest.raises(WireFormatError, match="expected one mask, found both"):
        decode("slime", body(meta))
