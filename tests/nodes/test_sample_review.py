"""One sample in every form a trainer may hand it over gives the same batch; a value that is
not what the field holds is a typed error naming the field, never a silent conversion."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from r3data import loader
from r3data.errors import TraceError
from r3data.nodes.options import TraceOptions
from r3data.nodes.sample import as_rollout, field_forms, sample_files
from r3data.nodes.stitcher import StitchRollout
from r3data.payload import PayloadWriter
from r3data.trace import TraceBuilder
from r3data.wire.rows import InlineRows

LAYERS, TOPK = 2, 2
ROUTES = "routed_experts"
TURNS = ((3, 2), (6, 3))  # (prompt_len, completion_len): the second extends the first
TOKENS = 9


def rows(lo: int, hi: int, turn: int) -> np.ndarray:
    p = np.arange(lo, hi) + 1
    return np.stack([np.stack([p, p * 0 + turn], -1)] * LAYERS, 1).astype(np.uint8)


class Frozen(Mapping):
    """A read-only mapping that is not a dict (a config object, a dataset row view)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@dataclass
class Rollout:
    sample_id: str
    token_ids: Any
    loss_mask: Any
    requests: Any = None
    trace: Any = None


def forms(segment_dict: dict, turn2: InlineRows):
    """The same sample as dicts, mappings, dataclasses and ready traces, with token ids,
    masks and lengths of every accepted type."""
    mask = [False] * 3 + [True] * 2 + [False] + [True] * 3
    requests = [
        {"prompt_len": np.int64(3), "completion_len": np.uint8(2), "sources": [segment_dict]},
        {"prompt_len": 6, "completion_len": np.int32(3), "sources": (turn2,)},
    ]
    builder = TraceBuilder("s")
    builder.add_request(3, 2, [InlineRows("routed_experts", rows(0, 4, 1), 0)])
    builder.add_request(6, 3, [turn2])
    tokens = np.arange(TOKENS) + 100
    yield "dict", {"id": "s", "token_ids": tokens, "loss_mask": mask, "requests": requests}
    yield (
        "ordered dict, tuple ids, 0/1 mask",
        OrderedDict(
            sample_id="s",
            token_ids=tuple(tokens.tolist()),
            loss_mask=np.array(mask, np.uint8),
            requests=tuple(requests),
        ),
    )
    yield (
        "mapping, list ids, int mask",
        Frozen(
            {
                "id": "s",
                "input_ids": tokens.tolist(),
                "loss_mask": np.array(mask, np.int64),
                "requests": [Frozen(r) for r in requests],
            }
        ),
    )
    yield "dataclass, torch", Rollout("s", torch.tensor(tokens), torch.tensor(mask), requests)
    yield "dataclass, builder", Rollout("s", tokens.astype(np.int32), mask, trace=builder)
    yield (
        "dict, trace",
        {"id": "s", "token_ids": tokens, "loss_mask": mask, "trace": builder.build()},
    )


def test_every_form_of_a_sample_gives_the_same_batch(tmp_path):
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows(0, 4, 1)})
    turn2 = InlineRows("routed_experts", rows(4, 8, 2), 4)
    batches = {}
    for name, sample in forms(segment.to_dict(), turn2):
        (batch,) = loader([sample], batch_size=1, prefetch=0, payload_root=tmp_path)
        batches[name] = batch
    expected = np.concatenate([rows(0, 4, 1), rows(4, 8, 2), rows(7, 8, 2)])
    for name, batch in batches.items():
        assert batch["sample_id"] == ["s"], name
        assert batch["token_ids"][0].tolist() == list(range(100, 100 + TOKENS)), name
        assert batch["loss_mask"][0].tolist() == [False] * 3 + [True] * 2 + [False] + [True] * 3
        np.testing.assert_array_equal(batch["routed_experts"][0].numpy(), expected, err_msg=name)
        assert batch["routed_experts_valid"][0].tolist() == [True] * 8 + [False], name


def test_sample_files_agree_with_the_normalised_sample(tmp_path):
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows(0, 4, 1)})
    turn2 = InlineRows("routed_experts", rows(4, 8, 2), 4)
    for name, sample in forms(segment.to_dict(), turn2):
        if "builder" in name or "trace" in name:
            continue  # a ready trace here holds inline rows only
        assert sample_files(sample) == as_rollout(sample, 0).files == (segment.file,), name


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_mask", [1, 0, -1, 1, 1], "loss_mask must be booleans or 0/1, found dtype int64 "),
        ("loss_mask", [1, 0, 2, 1, 1], "with values up to 2"),
        ("loss_mask", np.array([1, 0, 255, 1, 1], np.uint8), "with values up to 255"),
        ("loss_mask", [1.0, 0.0, 1.0, 1.0, 1.0], "booleans or 0/1, found dtype float64"),
        ("loss_mask", [True] * 4, r"loss_mask must be 1-D with 5 entries, found shape \(4,\)"),
        ("token_ids", [1.0, 2.0, 3.0, 4.0, 5.0], "token_ids must be integers, found dtype float"),
        ("token_ids", [[1, 2, 3, 4, 5]], r"token_ids must be 1-D"),
        ("logprobs", ["a"] * 5, "logprobs must be numbers, found dtype <U1"),
        (
            "token_ids",
            np.array([1, 2, 3, 4, 2**64 - 1], np.uint64),  # was read as -1
            f"must be integers that fit int64, found {2**64 - 1}",
        ),
    ],
)
def test_a_vector_that_is_not_what_its_field_holds_is_refused(field, value, message):
    sample = {
        "id": "v",
        "token_ids": list(range(5)),
        "requests": [{"prompt_len": 2, "completion_len": 3, "sources": []}],
        field: value,
    }
    with pytest.raises(TraceError, match=rf"^sample 'v' \(index 0\): .*{message}"):
        as_rollout(sample, 0)


def test_a_negative_loss_mask_entry_is_not_read_as_true():
    sample = {"id": "m", "token_ids": [1, 2], "loss_mask": [-1, 1], "requests": []}
    with pytest.raises(
        TraceError,
        match="loss_mask must be booleans or 0/1, found dtype int64 with values down to -1",
    ):
        as_rollout(sample, 0)


@pytest.mark.parametrize("empty", [[], (), np.zeros(0, np.int64), torch.zeros(0, dtype=torch.long)])
def test_an_empty_sample_is_empty_whatever_holds_its_ids(empty):
    sample = {"id": "e", "token_ids": empty, "loss_mask": [], "requests": []}
    rollout = as_rollout(sample, 0)
    assert rollout.sample_len == 0
    assert rollout.token_ids.dtype == np.int64
    assert rollout.loss_mask.dtype == bool


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ((True, 2), "prompt_len: expected an int in \\[0, 9223372036854775807\\], found True"),
        ((2.0, 2), "prompt_len: expected an int in \\[0, 9223372036854775807\\], found 2.0"),
        (
            (2, np.float32(2)),
            "completion_len: expected an int in \\[0, 9223372036854775807\\], found np.float32",
        ),
        (
            (np.bool_(True), 2),
            "prompt_len: expected an int in \\[0, 9223372036854775807\\], found np.True_",
        ),
        (
            (2, 2**63),
            "completion_len: expected an int in \\[0, 9223372036854775807\\], found 9223372036854775808",
        ),
        ((-1, 2), "prompt_len: expected an int in \\[0, 9223372036854775807\\], found -1"),
    ],
)
def test_lengths_that_are_not_counts_are_refused(lengths, message):
    prompt_len, completion_len = lengths
    sample = {
        "id": "l",
        "token_ids": list(range(4)),
        "requests": [{"prompt_len": prompt_len, "completion_len": completion_len}],
    }
    with pytest.raises(TraceError, match=rf"sample 'l' \(index 0\): {message}"):
        as_rollout(sample, 0)


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ({"requests": 5}, r"'requests': expected a list of requests, found int"),
        (
            {"requests": [{"prompt_len": 3, "completion_len": 2, "sources": 5}]},
            r"request 0 'sources': expected a list of sources, found int",
        ),
    ],
)
def test_requests_or_sources_that_are_no_list_are_a_trace_error(sample, match):
    """A TypeError from iterating them was untyped, and broke another rank's empty
    micro-batch, which skips a sample it cannot read (its owner reports it)."""
    bad = {"id": "bad", "token_ids": np.arange(TOKENS), **sample}
    with pytest.raises(TraceError, match=match):
        as_rollout(bad, 0, TraceOptions())
    good = {
        "id": "good",
        "token_ids": np.arange(TOKENS),
        "requests": [
            {
                "prompt_len": 3,
                "completion_len": 2,
                "sources": [InlineRows(ROUTES, rows(0, 4, 1), 0)],
            }
        ],
    }
    forms = field_forms([(0, bad), (1, good)], (ROUTES,), TraceOptions())
    assert forms[ROUTES].row_shape == (LAYERS, TOPK)


def test_a_stitch_stage_given_one_field_as_a_string_stitches_that_field():
    """``StitchRollout(fields="routed_experts")`` is one field, as ``stitch`` reads it: the
    check for fields without rows read the string letter by letter and dropped every sample."""
    rows = InlineRows("routed_experts", np.ones((7, 2, 2), np.uint8), 0)
    request = {"prompt_len": 4, "completion_len": 4, "sources": [rows]}
    sample = {"id": "s", "token_ids": np.arange(8), "requests": [request]}
    out = StitchRollout(fields="routed_experts")((0, sample))
    assert out.warnings == ()
    assert out.stitched is not None
    assert list(out.stitched.fields) == ["routed_experts"]
