"""A routes segment by handle is held to the row shape inline routes are: ``[layers > 0, topk >
0]``. Before, a ``shape`` of ``[]`` (every row one byte of the field), ``[6]`` or ``[3, 2, 1]``
was accepted and the loader built batches of such rows, all valid, caught (if at all) only
by ``expand``. Other fields' segments keep their own rules."""

from __future__ import annotations

import re
import warnings

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data import loader
from r3data.errors import R3DataError, TraceError, WireFormatError
from r3data.payload import PayloadWriter
from r3data.trace import TraceBuilder
from r3data.wire import pack_ndarray
from r3data.wire.producers.common import check_route_shape
from r3data.wire.rows import InlineRows, check_route_row_shape
from r3data.wire.segment import PayloadSegment

P, C, L, K = 5, 4, 3, 2
ROWS = P + C - 1
EXPECTED = r"expected routes \[rows, layers > 0, topk > 0\], found rows of "


def _segment(shape, field="routed_experts", rows=ROWS, **extra) -> PayloadSegment:
    return PayloadSegment(field, "v0/a.bin", 0, 0, rows, "uint8", tuple(shape), **extra)


def _written(tmp_path) -> dict:
    routes = np.random.default_rng(0).integers(1, 16, (ROWS, L, K), dtype=np.uint8)
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": routes}, pos=0)
    return segment.to_dict()


def _load(tmp_path, source: dict):
    sample = {
        "id": "s0",
        "token_ids": np.arange(P + C),
        "requests": [{"prompt_len": P, "completion_len": C, "sources": [source]}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(loader([sample], batch_size=1, num_experts=16, payload_root=tmp_path))


@pytest.mark.parametrize("shape", [[], [6], [3, 2, 1]])
def test_the_loader_refuses_a_routes_handle_of_another_row_shape(tmp_path, shape):
    """The reproducer's shapes (``[]``: each row one byte of the field); before, each was read
    into a batch of such rows, all valid."""
    handle = _written(tmp_path)
    del handle["crc32c"]  # as a router that re-describes the bytes would send them
    with pytest.raises(TraceError) as caught:
        _load(tmp_path, {**handle, "shape": shape})
    message = str(caught.value)
    assert message.startswith("sample 's0' (index 0): ")
    expected = rf"field 'routed_experts': segment at position 0: {EXPECTED}{re.escape(str(shape))}$"
    assert caught.match(expected), message


def test_the_loader_reads_a_routes_handle_of_layers_by_topk(tmp_path):
    (batch,) = _load(tmp_path, _written(tmp_path))
    assert tuple(batch["routed_experts"].values.shape[1:]) == (L, K)
    assert batch["routed_experts_valid"].values.tolist() == [True] * ROWS + [False]


def test_inline_and_by_handle_routes_are_refused_alike(tmp_path):
    """The same message tail, the inline one from the producer, the handle's from the trace."""
    envelope = pack_ndarray(np.ones((ROWS, 3, 0), np.uint8))  # no topk axis
    body = {"choices": [{"token_ids": list(range(C)), "routed_experts": envelope}]}
    with pytest.raises(WireFormatError, match=rf"{EXPECTED}\[3, 0\]$"):
        _load(tmp_path, {"producer": "prime-rl", "response": orjson.dumps(body)})
    with pytest.raises(TraceError, match=rf"segment at position 0: {EXPECTED}\[3, 0\]$"):
        _load(tmp_path, {**_written(tmp_path), "shape": [3, 0], "crc32c": None})


@pytest.mark.parametrize("shape", [[L, K], [L * K], [L, K, 1]])
def test_a_prime_rl_body_by_handle_is_held_to_the_rule(tmp_path, shape):
    """The PrimeIntellect router's ``choices[i].payload`` handles reach the same check."""
    handle = {**_written(tmp_path), "shape": shape, "crc32c": None}
    choice = {"token_ids": list(range(C)), "payload": [handle]}
    body = {"choices": [choice], "usage": {"prompt_tokens": P, "completion_tokens": C}}
    source = {"producer": "prime-rl", "response": orjson.dumps(body)}
    if shape == [L, K]:
        (batch,) = _load(tmp_path, source)
        assert tuple(batch["routed_experts"].values.shape[1:]) == (L, K)
        return
    with pytest.raises(
        TraceError, match=rf"segment at position 0: {EXPECTED}{re.escape(str(shape))}$"
    ):
        _load(tmp_path, source)


def test_a_refused_handle_leaves_the_trace_as_it_was():
    builder = TraceBuilder("t")
    builder.add_request(P, C, [_segment((L, K))])
    before = builder.build()
    with pytest.raises(TraceError, match=rf"trace 't' field 'routed_experts': .*{EXPECTED}\[\]"):
        builder.add_request(P, C + 1, [_segment(())])
    after = builder.build()
    assert after.requests == before.requests
    assert dict(after.pieces) == dict(before.pieces)


def test_the_rule_follows_the_routes_field_and_spares_other_fields():
    """``routes_field`` names the field held to it; side channels keep their own rules: a
    ragged mask has row shape ``()``, a padded one ``[width]``, logprobs ``()``."""
    custom = TraceBuilder("t", routes_field="experts")
    with pytest.raises(TraceError, match=rf"field 'experts': .*{EXPECTED}\[6\]"):
        custom.add_request(P, C, [_segment((6,), field="experts")])
    custom.add_request(P, C, [_segment((3, 2, 1), field="routed_experts")])  # not routes here
    builder = TraceBuilder("t")
    builder.add_request(
        P,
        C,
        [
            _segment((L, K)),
            PayloadSegment("sampling_mask", "v0/a.bin", 0, P, C, "int32", (), index=64),
            PayloadSegment("logprobs", "v0/a.bin", 0, P, C, "float32", ()),
            PayloadSegment("token_mask", "v0/a.bin", 0, P, C, "int32", (3,)),
        ],
    )
    assert set(builder.build().info) == {
        "routed_experts",
        "sampling_mask",
        "logprobs",
        "token_mask",
    }


def _verdict(check) -> str | None:
    try:
        check()
    except R3DataError as exc:
        return str(exc).rsplit(": ", 1)[-1]
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=5), st.integers(0, ROWS))
def test_a_handle_is_accepted_iff_inline_rows_of_its_shape_are(shape, rows):
    """Random row shapes: a by-handle routes segment is accepted exactly when it is
    ``[layers > 0, topk > 0]``, which is when the producers' inline check accepts rows of that
    shape, and both say the same of a refused one."""
    shape = tuple(shape)
    builder = TraceBuilder("t")
    by_handle = _verdict(lambda: builder.add_request(P, C, [_segment(shape, rows=rows)]))
    inline_rows = InlineRows("routed_experts", np.zeros((rows, *shape), np.uint8), 0)
    inline = _verdict(lambda: check_route_shape(inline_rows, "inline"))
    helper = _verdict(lambda: check_route_row_shape(shape, "rule", TraceError))
    assert by_handle == inline == helper
    assert (by_handle is None) == (len(shape) == 2 and 0 not in shape)
    if by_handle is not None:
        assert by_handle.endswith(f"topk > 0], found rows of {list(shape)}")
        assert builder.build().requests == ()


def test_the_helper_raises_the_error_class_asked_for():
    with pytest.raises(WireFormatError, match=rf"^routes: {EXPECTED}\[0, 8\]$"):
        check_route_row_shape((0, 8), "routes")
    with pytest.raises(TraceError, match=rf"^routes: {EXPECTED}\[48\]$"):
        check_route_row_shape((48,), "routes", TraceError)
    check_route_row_shape((48, 8), "routes")
