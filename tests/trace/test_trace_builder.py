"""TraceBuilder: overlap resolution, anchoring helpers and the validation hooks."""

from __future__ import annotations

import base64
import io
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_engine import engine_rows, materialized, routes

from r3data.errors import ConfigError, TraceError
from r3data.nodes import ScreenOptions
from r3data.payload.reader import PayloadReader
from r3data.payload.writer import PayloadWriter
from r3data.spans import complement, intersect, merge
from r3data.trace import (
    TraceBuilder,
    distinct_row,
    stitch,
    widened_dtype,
)
from r3data.wire import vllm_routes
from r3data.wire.rows import InlineRows


def spans_of(builder: TraceBuilder, field: str = "routed_experts") -> list[tuple[int, int]]:
    return [(p.pos, p.end) for p in builder.build().pieces[field]]


def test_a_source_inside_an_earlier_one_splits_it_into_views():
    builder = TraceBuilder("t")
    first = routes(1, 0, 10)
    builder.add_request(6, 5, [first])
    builder.add_request(6, 5, [routes(2, 3, 5)])
    assert spans_of(builder) == [(0, 3), (3, 5), (5, 10)]
    head, _, tail = builder.build().pieces["routed_experts"]
    assert np.shares_memory(head.array, first.array)
    assert np.shares_memory(tail.array, first.array)
    np.testing.assert_array_equal(tail.array, engine_rows(1, 5, 10))


def test_a_source_spanning_several_pieces_replaces_them(payload):
    write, _ = payload
    builder = TraceBuilder("t")
    (first,) = write(routes(1, 0, 5))
    builder.add_request(4, 2, [first])
    builder.add_request(8, 2, [routes(2, 5, 9)])
    (third,) = write(routes(3, 9, 13))
    builder.add_request(12, 2, [third])
    builder.add_request(12, 3, [routes(4, 2, 11)])
    assert spans_of(builder) == [(0, 2), (2, 11), (11, 13)]
    head, middle, tail = builder.build().pieces["routed_experts"]
    assert (head.file, head.offset, head.rows) == (first.file, first.offset, 2)
    assert (tail.file, tail.offset, tail.rows) == (third.file, third.offset + 2 * 4, 2)
    np.testing.assert_array_equal(middle.array, engine_rows(4, 2, 11))


def test_sources_of_one_request_must_not_overlap(payload):
    write, _ = payload
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [routes(1, 0, 6)])
    before = builder.build()
    overlapping = [
        [routes(2, 0, 6), routes(3, 0, 6)],  # two choices at the same positions
        [routes(2, 0, 4), routes(3, 3, 6)],  # one shared position
        [*write(routes(2, 3, 6)), routes(3, 0, 4)],  # by handle and inline, any order
        [routes(2, 0, 6), *write(routes(3, 5, 6))],
    ]
    for sources in overlapping:
        spans = sorted((s.pos, s.end) for s in sources)
        with pytest.raises(
            TraceError,
            match=rf"trace 't' field 'routed_experts': sources of one request overlap, "
            rf"\[{spans[0][0]}, {spans[0][1]}\) and \[{spans[1][0]}, {spans[1][1]}\)",
        ):
            builder.add_request(4, 3, sources)
    after = builder.build()
    assert after.requests == before.requests
    assert spans_of(builder) == [(0, 6)]
    np.testing.assert_array_equal(after.pieces["routed_experts"][0].array, engine_rows(1, 0, 6))
    # adjacent sources, empty ones, and other fields at the same positions are fine
    mask = InlineRows("sampling_mask", np.zeros((3, 2), np.int32), 4)
    empty = InlineRows("routed_experts", engine_rows(2, 3, 3), 3)
    builder.add_request(4, 3, [routes(2, 0, 3), empty, routes(3, 3, 6), mask])
    assert spans_of(builder) == [(0, 3), (3, 6)]
    # across requests the later one still wins
    builder.add_request(4, 3, [routes(4, 2, 6)])
    assert spans_of(builder) == [(0, 2), (2, 6)]


def test_a_multi_choice_response_is_refused():
    """vLLM decoded with ``choice=None`` gives one source per choice, all at position 0."""
    choices = []
    for seed in (1, 2):
        buffer = io.BytesIO()
        np.save(buffer, engine_rows(seed, 0, 6))
        choices.append({"routed_experts": base64.b64encode(buffer.getvalue()).decode()})
    sources = vllm_routes({"choices": choices})
    builder = TraceBuilder("conv")
    with pytest.raises(TraceError, match=r"'conv'.*overlap, \[0, 6\) and \[0, 6\)"):
        builder.add_request(4, 3, sources)
    builder.add_request(4, 3, vllm_routes({"choices": choices}, choice=1))
    np.testing.assert_array_equal(
        materialized(stitch(builder, 6), "routed_experts"), engine_rows(2, 0, 6)
    )


def test_sources_past_the_request_and_foreign_objects_are_refused():
    builder = TraceBuilder("t")
    with pytest.raises(TraceError, match=r"'t' field 'routed_experts'.*\[5, 10\).*9 tokens"):
        builder.add_request(5, 4, [routes(1, 5, 10)])
    with pytest.raises(TraceError, match="found dict"):
        builder.add_request(5, 4, [{"data": "..."}])


def test_a_refused_request_leaves_the_trace_unchanged():
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [routes(1, 0, 6)])
    before = builder.build()
    bad = InlineRows("routed_experts", np.full((2, 3, 2), 9, np.uint8), 6)  # another row shape
    with pytest.raises(TraceError):
        builder.add_request(9, 2, [routes(2, 6, 8), bad])
    after = builder.build()
    assert after.requests == before.requests
    assert spans_of(builder) == [(0, 6)]


def test_expert_ids_are_screened_against_num_experts():
    builder = TraceBuilder("t")
    array = engine_rows(1, 0, 6)  # ids up to 6
    array[4, 1, 0] = 8
    builder.add_request(4, 3, [InlineRows("routed_experts", array, 0)])
    sample = stitch(builder, 7)
    with pytest.raises(
        TraceError,
        match=r"field 'routed_experts': expected expert ids in \[0, 8\), found 8 at "
        r"position 4 \(layer 1\)",
    ):
        materialized(sample, "routed_experts", screen=ScreenOptions(num_experts=8))
    assert materialized(sample, "routed_experts", screen=ScreenOptions(num_experts=9))[4, 1, 0] == 8


@pytest.mark.parametrize("policy", ["missing", "raise", "keep"])
def test_all_zero_route_rows(policy, caplog):
    array = engine_rows(1, 0, 6)
    array[2:4] = 0
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [InlineRows("routed_experts", array, 0)])
    sample = stitch(builder, 7)
    screen = ScreenOptions(zero_rows=policy)
    if policy == "raise":
        with pytest.raises(TraceError, match=r"positions \[2, 3\] are zero in every layer"):
            materialized(sample, "routed_experts", screen=screen)
        return
    from r3data.nodes import fill_field

    filled = fill_field(
        "routed_experts", [sample["routed_experts"]], dtype=np.dtype("uint8"), screen=screen
    )
    if policy == "keep":
        assert filled.valid[:6].all()
        assert not filled.values.values[2:4].any()
        return
    # the rows are missing: a gap, the sample's routes dropped by default
    assert not filled.valid.any()
    assert (filled.stats.gaps, filled.stats.rows_missing) == (1, 2)
    assert any("[2, 4)" in w and "missing" in w for w in filled.warnings)
    assert (filled.values.values.numpy() == distinct_row((2, 2), np.dtype("uint8"))).all()


def test_route_dtypes_widen_across_turns_and_never_narrow():
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [routes(1, 0, 6, "uint8")])
    wide = engine_rows(2, 6, 10, "uint16")
    wide[0, 0, 0] = 300
    builder.add_request(9, 2, [InlineRows("routed_experts", wide, 6)])
    builder.add_request(13, 3, [routes(3, 10, 15, "uint8")])
    assert builder.build().info["routed_experts"].dtype == np.uint16
    routes_ = materialized(stitch(builder, 16), "routed_experts")
    assert routes_.dtype == np.uint16
    assert routes_[6, 0, 0] == 300
    builder.add_request(13, 3, [routes(4, 10, 15, "int32")])
    assert builder.build().info["routed_experts"].dtype == np.int32
    with pytest.raises(TraceError, match="expected route dtype"):
        builder.add_request(13, 3, [routes(4, 10, 15, "float32")])


def test_dtype_widening_rule():
    where = {"trace_id": "t", "field": "f", "pos": 3}
    assert widened_dtype(np.dtype("uint8"), np.dtype("uint16"), **where) == np.uint16
    assert widened_dtype(np.dtype("int32"), np.dtype("uint16"), **where) == np.int32
    assert widened_dtype(np.dtype("float16"), np.dtype("float32"), **where) == np.float32
    for a, b in [("int16", "uint16"), ("int32", "float32"), ("uint32", "int32")]:
        with pytest.raises(TraceError, match=f"'f': rows from position 3 have dtype {b}"):
            widened_dtype(np.dtype(a), np.dtype(b), **where)


def test_row_shapes_must_agree_across_turns():
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [routes(1, 0, 6)])
    wrong = InlineRows("routed_experts", np.ones((4, 3, 2), np.uint8), 6)
    with pytest.raises(TraceError, match=r"position 6 have row shape \[3, 2\], expected \[2, 2\]"):
        builder.add_request(9, 2, [wrong])
    with pytest.raises(TraceError, match="padded 2-D"):
        builder.add_request(9, 2, [InlineRows("sampling_mask", np.ones(2, np.int32), 4)])


def test_distinct_rows():
    np.testing.assert_array_equal(
        distinct_row((3, 4), np.dtype("uint8")), np.tile(np.arange(4), (3, 1))
    )
    flat = distinct_row((12,), np.dtype("int32"), topk=4)
    np.testing.assert_array_equal(flat, np.tile(np.arange(4), 3))
    with pytest.raises(TraceError, match="topk"):
        distinct_row((3, 8), np.dtype("uint8"), topk=4)  # would repeat experts within a layer
    with pytest.raises(TraceError, match="topk"):
        distinct_row((3, 300), np.dtype("uint8"))


span_lists = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=8)


@settings(max_examples=60, deadline=None)
@given(a=span_lists, b=span_lists, lo=st.integers(0, 20), width=st.integers(0, 25))
def test_span_algebra_matches_sets(a, b, lo, width):
    def points(spans):
        return {p for s, e in spans for p in range(s, e)}

    ma, mb = merge(a), merge(b)
    assert points(ma) == points(a)
    assert all(x[1] < y[0] for x, y in itertools.pairwise(ma))
    assert points(intersect(ma, mb)) == points(a) & points(b)
    assert points(complement(ma, lo, lo + width)) == set(range(lo, lo + width)) - points(a)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"zero_rows": "drop"}, "zero_rows: expected 'missing', 'raise' or 'keep', found 'drop'"),
        ({"num_experts": 0}, "num_experts: expected an int >= 1, found 0"),
        ({"num_experts": -3}, "num_experts: expected an int >= 1, found -3"),
        ({"num_experts": "8"}, "num_experts"),
    ],
)
def test_bad_screen_options_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        ScreenOptions(**options)


def test_bad_builder_options_are_config_errors():
    with pytest.raises(ConfigError, match="last_token_row: expected a bool, found 1"):
        TraceBuilder("t", last_token_row=1)


def test_builder_arguments_and_ragged_agreement(tmp_path):
    for bad in (-1, 2**63, True):
        with pytest.raises(
            TraceError, match=rf"prompt_len: expected an int in \[0, {2**63 - 1}\], found {bad}"
        ):
            TraceBuilder("t").add_request(bad, 3)
    rows = [np.array([1, 2], np.int32), np.array([3], np.int32), np.array([], np.int32)]
    ragged = PayloadWriter(tmp_path).write(0, {"token_mask": rows}, pos=4)
    builder = TraceBuilder("t")
    builder.add_request(4, 3, [InlineRows("token_mask", np.ones(3, np.int32), 4)])
    with pytest.raises(TraceError, match="'token_mask': ragged rows at position 4 after fixed"):
        builder.add_request(4, 3, ragged)
    # a field first sent ragged by handle takes padded inline rows later
    masks = TraceBuilder("t", ragged_fields=())
    masks.add_request(4, 3, ragged)
    masks.add_request(9, 2, [InlineRows("token_mask", np.full((2, 4), 7, np.int32), 9)])
    info = masks.build().info["token_mask"]
    assert (info.ragged, info.row_shape) == (True, ())  # ragged rows have no fixed width
    dense = materialized(
        stitch(masks, 11, fields=("token_mask",), on_gap="raise"),
        "token_mask",
        PayloadReader(tmp_path),
    )
    assert dense[4:7].tolist() == [[1, 2, -1, -1], [3, -1, -1, -1], [-1] * 4]
    assert dense[9:].tolist() == [[7] * 4] * 2


@pytest.mark.parametrize("handle_first", [True, False])
def test_padded_inline_rows_beside_ragged_ones_of_one_request_are_made_ragged(
    tmp_path, handle_first
):
    """A field not named ragged, sent ragged by handle and padded inline in one request, is
    ragged whatever the sources' order (it crashed the fill with the handle first and was
    refused with it second)."""
    rows = [np.array([5], np.int32), np.array([6, 7], np.int32), np.array([], np.int32)]
    (ragged,) = PayloadWriter(tmp_path).write(0, {"extra": rows})
    padded = InlineRows("extra", np.array([[9, -1], [8, 7], [-1, -1]], np.int32), 3)
    builder = TraceBuilder("t", ragged_fields=())
    builder.add_request(2, 4, [ragged, padded] if handle_first else [padded, ragged])
    trace = builder.build()
    assert (trace.info["extra"].ragged, trace.info["extra"].row_shape) == (True, ())
    inline = next(p for p in trace.pieces["extra"] if isinstance(p, InlineRows))
    assert inline.ragged
    assert inline.array.lengths.tolist() == [1, 2, 0]
    dense = materialized(
        stitch(trace, 6, fields=("extra",), on_gap="raise"), "extra", PayloadReader(tmp_path)
    )
    assert dense.tolist() == [[5, -1], [6, 7], [-1, -1], [9, -1], [8, 7], [-1, -1]]
