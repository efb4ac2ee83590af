"""Hand-checked multi-turn traces: which row each position gets, and which are valid."""

from __future__ import annotations

import numpy as np
import pytest
from trace_engine import engine_rows, materialized, routes

from r3data.errors import ConfigError, SegmentError, TraceError, TraceGapError
from r3data.trace import (
    PlaceholderRows,
    StitchStats,
    TraceBuilder,
    end_anchored_pos,
    start_anchored_pos,
    stitch,
)
from r3data.wire.rows import InlineRows
from r3data.wire.segment import PayloadSegment

# Three chat turns: (prompt_len, completion_len). Each prompt holds every earlier token plus
# 2 new user tokens, so the final sequence has 16 tokens and 15 forwarded positions.
TURNS = [(4, 3), (9, 2), (13, 3)]
LENGTH = 16


def vllm_trace(
    starts=(0, 6, 10), shorten=(0, 0, 0), extra=(0, 0, 0), last_token_row=False
) -> tuple:
    """vLLM answering with ``routed_experts_prompt_start`` = ``starts[j]``; an engine may send
    ``shorten[j]`` rows fewer or ``extra[j]`` more than the forwarded tokens."""
    builder = TraceBuilder("chat-1", last_token_row=last_token_row)
    arrays = []
    for turn, ((p, c), start) in enumerate(zip(TURNS, starts, strict=True), 1):
        rows = p + c - 1 - start - shorten[turn - 1] + extra[turn - 1]
        pos = start_anchored_pos(p, c, rows, prompt_start=start, last_token_row=last_token_row)
        source = routes(turn, pos, pos + rows)
        arrays.append(source.array)
        builder.add_request(p, c, [source])
    return builder, arrays


def turns_of(materialized: np.ndarray) -> list[int]:
    return materialized[:, 0, 0].tolist()


def positions_of(materialized: np.ndarray) -> list[int]:
    return (materialized[:, 0, 1].astype(int) - 1).tolist()


def test_three_turns_with_prompt_start():
    builder, arrays = vllm_trace()
    sample = stitch(builder, LENGTH)
    routes_ = materialized(sample, "routed_experts")
    assert turns_of(routes_) == [1] * 6 + [2] * 4 + [3] * 6
    # the final token is never forwarded: it repeats the row of position 14
    assert positions_of(routes_) == [*range(15), 14]
    assert sample.valid.tolist() == [True] * 15 + [False]
    pieces = sample["routed_experts"].pieces
    assert [(p.pos, p.end) for p in pieces] == [(0, 6), (6, 10), (10, 15), (15, 16)]
    assert pieces[-1].kind == "repeat_previous"
    for piece, array in zip(pieces[:-1], arrays, strict=True):
        assert np.shares_memory(piece.array, array)  # views, never copies
    assert np.shares_memory(pieces[-1].source.array, arrays[-1])  # it repeats the last row
    assert sample.stats == StitchStats(
        samples=1, rows_captured=15, placeholders=1, bytes=15 * routes_[0].nbytes
    )


def test_overlapping_starts_later_request_wins():
    builder, _ = vllm_trace(starts=(0, 4, 8))
    routes_ = materialized(stitch(builder, LENGTH), "routed_experts")
    assert turns_of(routes_) == [1] * 4 + [2] * 4 + [3] * 8
    assert positions_of(routes_) == [*range(15), 14]


def test_truncated_sample():
    builder, _ = vllm_trace()
    sample = stitch(builder, 12)
    assert turns_of(materialized(sample, "routed_experts")) == [1] * 6 + [2] * 4 + [3] * 2
    assert sample.valid.all()
    assert sample.stats.placeholders == 0
    assert [(p.pos, p.end) for p in sample["routed_experts"].pieces][-1] == (10, 12)


def test_synthetic_eos_repeats_or_gets_distinct_experts():
    builder, _ = vllm_trace()
    repeated = stitch(builder, LENGTH + 1)
    routes_ = materialized(repeated, "routed_experts")
    assert positions_of(routes_)[-3:] == [14, 14, 14]
    assert repeated.valid.tolist()[-3:] == [True, False, False]
    distinct = materialized(stitch(builder, LENGTH + 1, placeholder="distinct"), "routed_experts")
    np.testing.assert_array_equal(distinct[15:], [[[0, 1], [0, 1]]] * 2)
    np.testing.assert_array_equal(distinct[:15], routes_[:15])


def test_a_row_for_the_last_token_is_refused_unless_admitted(payload):
    write, _ = payload
    builder, _ = vllm_trace()
    before = builder.build()
    # rows [10, 16) for the last turn: one row for token 15, never forwarded
    for source in ([routes(3, 10, 16)], write(routes(3, 10, 16))):
        with pytest.raises(
            TraceError,
            match=r"'chat-1' field 'routed_experts': expected routes ending by position 15 "
            r"\(prompt_len 13 \+ completion_len 3 - 1.*found rows for \[10, 16\)",
        ):
            builder.add_request(13, 3, source)
    # the right number of rows, shifted by +1 (a source placed one position late)
    with pytest.raises(TraceError, match=r"found rows for \[11, 16\) \(shifted by \+1\?\)"):
        builder.add_request(13, 3, [routes(3, 11, 16)])
    assert builder.build().requests == before.requests
    # masks and logprobs sit on completion tokens: the last token has one
    builder.add_request(13, 3, [InlineRows("logprobs", np.zeros(3, np.float32), 13)])
    assert builder.build().pieces["logprobs"][0].end == 16
    # an engine that does send a row for the last token, admitted
    admitted, _ = vllm_trace(extra=(0, 0, 1), last_token_row=True)
    sample = stitch(admitted, LENGTH)
    assert sample.valid.all()
    assert positions_of(materialized(sample, "routed_experts")) == list(range(16))
    with pytest.raises(TraceError, match=r"\[10, 17\), past the 16 tokens"):
        admitted.add_request(13, 3, [routes(4, 10, 17)])


def test_with_last_token_row_a_missing_last_row_is_a_gap():
    # the engine sends rows for the last token, so one it did not send is missing, not the
    # never-forwarded token's placeholder
    builder, _ = vllm_trace(last_token_row=True)  # each turn one row short of its last token
    with pytest.raises(TraceGapError, match=r"'chat-1' field 'routed_experts'.*\[15, 16\)"):
        stitch(builder, LENGTH, on_gap="raise")
    assert stitch(builder, LENGTH, on_gap="drop_sample") is None
    assert stitch(builder, LENGTH - 1, on_gap="raise").valid.all()  # the row's token cut off
    complete, _ = vllm_trace(extra=(0, 0, 1), last_token_row=True)
    assert complete.build().expected("routed_experts") == [(0, LENGTH)]
    assert stitch(complete, LENGTH, on_gap="raise").valid.all()
    assert builder.build().expected("logprobs") == [(4, 7), (9, 11), (13, 16)]


def test_engine_returning_the_full_prefix_each_turn():
    builder, arrays = vllm_trace(starts=(0, 0, 0))
    trace = builder.build()
    assert len(trace.pieces["routed_experts"]) == 1  # earlier turns fully replaced
    sample = stitch(trace, LENGTH)
    assert turns_of(materialized(sample, "routed_experts")) == [3] * 16
    assert np.shares_memory(sample["routed_experts"].pieces[0].array, arrays[-1])


def test_engine_one_row_short_is_a_gap_for_each_on_gap():
    builder, _ = vllm_trace(shorten=(0, 0, 1))
    with pytest.raises(TraceGapError, match=r"'chat-1'.*'routed_experts'.*\[14, 15\)"):
        stitch(builder, LENGTH, on_gap="raise")
    assert stitch(builder, LENGTH, on_gap="drop_sample") is None
    dropped = stitch(builder, LENGTH, on_gap="drop_routes")
    assert not dropped.valid.any()
    np.testing.assert_array_equal(
        materialized(dropped, "routed_experts"), np.broadcast_to([[0, 1], [0, 1]], (16, 2, 2))
    )
    assert any("'chat-1'" in w and "[14, 15)" in w for w in dropped.warnings)
    assert dropped.stats == StitchStats(samples=1, placeholders=16, gaps=1, rows_dropped=14)
    # a sample truncated before the gap has none
    assert stitch(builder, 14, on_gap="raise").valid.all()


def test_off_by_one_prompt_start_leaves_a_gap_inside():
    builder, _ = vllm_trace(starts=(0, 7, 10))
    with pytest.raises(TraceGapError, match=r"\[6, 7\)"):
        stitch(builder, LENGTH, on_gap="raise")


def test_batch_statistics_sum_samples_and_count_dropped():
    good, _ = vllm_trace()
    short, _ = vllm_trace(shorten=(0, 0, 1))
    samples = [
        stitch(good, LENGTH),
        stitch(short, LENGTH, on_gap="drop_sample"),
        stitch(short, LENGTH),
    ]
    total = StitchStats.total(samples)
    assert total.samples == 3
    assert total.samples_dropped == 1
    assert total.rows_captured == samples[0].stats.rows_captured
    assert total.placeholders == 1 + 16
    assert total.rows_dropped == 14


def test_prime_rl_end_anchored_by_handle(payload):
    write, reader = payload
    builder = TraceBuilder("chat-2")
    covered = 0
    segments = []
    for turn, (p, c) in enumerate(TURNS, 1):
        rows = p + c - 1 - covered
        pos = end_anchored_pos(p, c, rows)
        assert pos == covered
        segments.append(write(routes(turn, pos, pos + rows))[0])
        builder.add_request(p, c, [segments[-1]])
        covered += rows
    sample = stitch(builder, LENGTH + 1)
    pieces = sample["routed_experts"].pieces
    assert all(isinstance(p, PayloadSegment) for p in pieces[:-1])
    last = segments[-1]
    row_14 = last.offset + (14 - last.pos) * last.row_bytes
    placeholder = pieces[-1]
    assert isinstance(placeholder, PlaceholderRows)
    assert (placeholder.pos, placeholder.rows, placeholder.kind) == (15, 2, "repeat_previous")
    source = placeholder.source  # the one row it repeats, re-pointed, not read here
    assert (source.pos, source.rows, source.offset, source.file) == (14, 1, row_14, last.file)
    routes_ = materialized(sample, "routed_experts", reader)
    np.testing.assert_array_equal(routes_[15], engine_rows(3, 14, 15)[0])
    np.testing.assert_array_equal(routes_[16], engine_rows(3, 14, 15)[0])
    assert turns_of(routes_) == [1] * 6 + [2] * 4 + [3] * 7
    with pytest.raises(SegmentError, match="reader"):
        materialized(sample, "routed_experts")


def test_handles_and_inline_mix_and_clip(payload):
    write, reader = payload
    builder = TraceBuilder("chat-3")
    builder.add_request(4, 3, write(routes(1, 0, 6)))
    builder.add_request(9, 2, [routes(2, 4, 10)])
    builder.add_request(13, 3, write(routes(3, 8, 15)))
    sample = stitch(builder, 14, placeholder="distinct")
    kinds = [(type(p).__name__, p.pos, p.end) for p in sample["routed_experts"].pieces]
    assert kinds == [
        ("PayloadSegment", 0, 4),
        ("InlineRows", 4, 8),
        ("PayloadSegment", 8, 14),
    ]
    routes_ = materialized(sample, "routed_experts", reader)
    assert turns_of(routes_) == [1] * 4 + [2] * 4 + [3] * 6
    assert positions_of(routes_) == list(range(14))


def masks(lo: int, widths: list[int]) -> InlineRows:
    """Sampling-mask rows padded with -1: row i keeps ``widths[i]`` ids ``100*pos + j``."""
    array = np.full((len(widths), max(widths)), -1, dtype=np.int32)
    for i, w in enumerate(widths):
        array[i, :w] = 100 * (lo + i) + np.arange(w)
    return InlineRows("sampling_mask", array, lo)


def mask_sources() -> list[InlineRows]:
    return [masks(4, [2, 1, 2]), masks(9, [3, 1]), masks(13, [1, 1, 1])]


def test_sampling_masks_are_anchored_on_completion_tokens():
    builder, _ = vllm_trace()
    trace = TraceBuilder("chat-4")
    for (p, c), route, mask in zip(
        TURNS, builder.build().pieces["routed_experts"], mask_sources(), strict=True
    ):
        trace.add_request(p, c, [route, mask])
    sample = stitch(trace, LENGTH + 1, fields=("routed_experts", "sampling_mask"))
    mask = sample["sampling_mask"]
    completion = [4, 5, 6, 9, 10, 13, 14, 15]
    assert np.flatnonzero(mask.valid).tolist() == completion
    assert sample.valid.tolist() == [True] * 15 + [False, False]  # the routes' mask
    dense = materialized(sample, "sampling_mask")
    assert dense.shape == (17, 3)
    assert dense[5].tolist() == [500, -1, -1]
    assert dense[9].tolist() == [900, 901, 902]
    prompt = [p for p in range(17) if p not in completion]
    assert (dense[prompt] == -1).all()
    assert sample.stats.gaps == 0
    assert sample.stats.rows_captured == 15 + len(completion)


def test_ragged_masks_by_handle_equal_inline(payload, tmp_path):
    from r3data.payload.writer import PayloadWriter

    _, reader = payload
    writer = PayloadWriter(tmp_path)
    inline, by_handle = TraceBuilder("m"), TraceBuilder("m")
    for (p, c), mask in zip(TURNS, mask_sources(), strict=True):
        rows = [row[row >= 0] for row in mask.array]
        inline.add_request(p, c, [mask])
        by_handle.add_request(p, c, writer.write(0, {"sampling_mask": rows}, pos=mask.pos))
    a = stitch(inline, 15, fields=("sampling_mask",), on_gap="raise")
    b = stitch(by_handle, 15, fields=("sampling_mask",), on_gap="raise")
    assert b["sampling_mask"].ragged
    np.testing.assert_array_equal(a["sampling_mask"].valid, b["sampling_mask"].valid)
    np.testing.assert_array_equal(
        materialized(a, "sampling_mask"), materialized(b, "sampling_mask", reader)
    )


def test_missing_masks_of_one_turn_drop_only_that_field():
    builder, _ = vllm_trace()
    trace = TraceBuilder("chat-5")
    for j, ((p, c), route, mask) in enumerate(
        zip(TURNS, builder.build().pieces["routed_experts"], mask_sources(), strict=True)
    ):
        trace.add_request(p, c, [route] if j == 1 else [route, mask])
    with pytest.raises(TraceGapError, match=r"'sampling_mask'.*\[9, 11\)"):
        stitch(trace, LENGTH, fields=("routed_experts", "sampling_mask"), on_gap="raise")
    sample = stitch(trace, LENGTH, fields=("routed_experts", "sampling_mask"))
    assert sample.valid[:15].all()
    assert not sample["sampling_mask"].valid.any()
    assert (materialized(sample, "sampling_mask") == -1).all()


def test_logprobs_fill_prompt_positions_with_zero():
    trace = TraceBuilder("chat-6")
    for turn, (p, c) in enumerate(TURNS, 1):
        logprobs = -np.arange(1, c + 1, dtype=np.float32) * turn
        trace.add_request(p, c, [InlineRows("logprobs", logprobs, p)])
    sample = stitch(trace, LENGTH, fields=("logprobs",))
    values = materialized(sample, "logprobs")
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values[13:16], [-3, -6, -9])
    assert values[[0, 1, 2, 3, 7, 8, 11, 12]].tolist() == [0.0] * 8
    assert sample.valid.sum() == 8


def test_stitch_refuses_bad_arguments():
    builder, _ = vllm_trace()
    with pytest.raises(TraceError, match="sample_len"):
        stitch(builder, -1)
    # bad option values are configuration errors, as everywhere in r3data
    with pytest.raises(ConfigError, match="placeholder: expected 'repeat_previous'"):
        stitch(builder, 4, placeholder="zeros")
    with pytest.raises(ConfigError, match="on_gap: expected 'drop_routes'"):
        stitch(builder, 4, on_gap="ignore")
    with pytest.raises(ConfigError, match="distinct field names"):
        stitch(builder, 4, fields=("routed_experts", "routed_experts"))
    for topk in (0, -2, 1.5):
        with pytest.raises(ConfigError, match="topk: expected an int >= "):
            stitch(builder, 4, topk=topk)
    with pytest.raises(TraceError, match="'logprobs': no rows anywhere"):
        stitch(builder, 4, fields=("routed_experts", "logprobs"), on_gap="drop_routes")
    with pytest.raises(TraceGapError, match="'logprobs'"):
        stitch(builder, 8, fields=("logprobs",), on_gap="raise")
