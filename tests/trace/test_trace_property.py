"""Random traces: by handle equals inline, and every valid row is the engine's row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_engine import engine_rows, materialized

from r3data.errors import TraceError
from r3data.payload.reader import PayloadReader
from r3data.payload.writer import PayloadWriter
from r3data.trace import TraceBuilder, distinct_row, stitch
from r3data.wire.rows import InlineRows


@st.composite
def traces(draw):
    """Turns ``(prompt_len, completion_len, lo, hi, dtype, by_handle)``: rows ``[lo, hi)``."""
    turns, tokens = [], 0
    for _ in range(draw(st.integers(1, 4))):
        prompt = tokens + draw(st.integers(1, 4))
        completion = draw(st.integers(1, 5))
        forwarded = prompt + completion - 1
        lo = draw(
            st.sampled_from(
                [max(tokens - 1, 0), 0, draw(st.integers(0, prompt))]
            )  # prompt_start at the first missing row, the full prefix, anything
        )
        hi = max(lo, forwarded + draw(st.sampled_from([0, 0, 0, -1, 1])))  # one short, one extra
        dtype = draw(st.sampled_from(["uint8", "uint16"]))
        turns.append((prompt, completion, lo, hi, dtype, draw(st.booleans())))
        tokens = prompt + completion
    sample_len = draw(st.one_of(st.integers(tokens, tokens + 2), st.integers(0, tokens)))
    placeholder = draw(st.sampled_from(["repeat_previous", "distinct"]))
    return turns, sample_len, placeholder, draw(st.booleans())


@settings(max_examples=50, deadline=None)
@given(case=traces())
def test_by_handle_equals_inline_and_valid_rows_are_the_engines(case, tmp_path_factory):
    turns, n, placeholder, last_token_row = case
    root = tmp_path_factory.mktemp("payload")
    writer, reader = PayloadWriter(root), PayloadReader(root, workers=2)
    inline = TraceBuilder("p", last_token_row=last_token_row)
    by_handle = TraceBuilder("p", last_token_row=last_token_row)
    engine: dict[int, np.ndarray] = {}  # naive reference: the latest row per position
    expected: set[int] = set()
    for turn, (prompt, completion, lo, hi, dtype, handle) in enumerate(turns, 1):
        rows = InlineRows("routed_experts", engine_rows(turn, lo, hi, dtype), lo)
        sources = (
            writer.write(0, {rows.field: rows.array}, pos=lo) if handle and hi > lo else [rows]
        )
        if hi == prompt + completion and not last_token_row:  # a row for the last token
            for builder, refused in ((inline, [rows]), (by_handle, sources)):
                with pytest.raises(TraceError, match="last token is never forwarded"):
                    builder.add_request(prompt, completion, refused)
            continue
        inline.add_request(prompt, completion, [rows])
        by_handle.add_request(prompt, completion, sources)
        engine.update({p: rows.array[p - lo] for p in range(lo, hi)})
        expected.update(range(prompt + completion - (not last_token_row)))

    if "routed_experts" not in inline.build().info:  # every turn refused or empty
        with pytest.raises(TraceError, match="no rows anywhere"):
            stitch(inline, n, placeholder=placeholder)
        return
    a = stitch(inline, n, placeholder=placeholder)
    b = stitch(by_handle, n, placeholder=placeholder)
    from_inline = materialized(a, "routed_experts")
    np.testing.assert_array_equal(from_inline, materialized(b, "routed_experts", reader))
    np.testing.assert_array_equal(a.valid, b.valid)
    assert a.stats.rows_captured == b.stats.rows_captured == int(a.valid.sum())

    distinct = distinct_row((2, 2), np.dtype("uint8"))
    if any(p in expected and p not in engine for p in range(n)):  # a gap: routes dropped
        assert not a.valid.any()
        assert (from_inline == distinct).all()
        return
    assert a.valid.tolist() == [p in engine for p in range(n)]
    previous = None
    for p in range(n):
        if p in engine:
            np.testing.assert_array_equal(from_inline[p], engine[p])
            previous = engine[p]
        elif placeholder == "repeat_previous" and previous is not None:
            np.testing.assert_array_equal(from_inline[p], previous)
        else:
            np.testing.assert_array_equal(from_inline[p], distinct)
