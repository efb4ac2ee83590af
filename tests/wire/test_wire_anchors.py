"""The anchoring rule: where a request's route rows sit, and every producer following it."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import r3data.trace
from r3data.errors import ConfigError, EngineRoutesError
from r3data.wire import (
    anchored_pos,
    end_anchored_pos,
    pack_ndarray,
    primerl_routes,
    routes_end,
    sglang_routes,
    start_anchored_pos,
    vllm_routes,
)

SETTINGS = settings(max_examples=40, deadline=None)


def test_routes_end_at_the_last_forwarded_token():
    # 4 prompt + 3 completion tokens: positions 0..6; 6 (the last sampled token) is never fed
    # back, so rows cover [0, 6)
    assert routes_end(4, 3) == 6
    assert routes_end(4, 3, last_token_row=True) == 7
    assert routes_end(1, 0) == 0
    assert routes_end(0, 0) == 0


def test_end_anchored_positions():
    assert end_anchored_pos(4, 3, 6) == 0
    assert end_anchored_pos(9, 2, 4) == 6  # rows for 6, 7, 8, 9; 10 is the last token
    assert end_anchored_pos(9, 2, 0) == 10
    with pytest.raises(EngineRoutesError, match=r"at most 6 route rows \(prompt 4 \+ comp"):
        end_anchored_pos(4, 3, 7)
    with pytest.raises(ConfigError, match="rows: expected an int >= 0, found -1"):
        end_anchored_pos(4, 3, -1)
    with pytest.raises(ConfigError, match="prompt_len"):
        end_anchored_pos(True, 3, 1)


def test_start_anchored_positions():
    assert start_anchored_pos(9, 2, 4, prompt_start=6) == 6
    assert start_anchored_pos(9, 2, 4, prompt_start=np.int64(6)) == 6
    assert start_anchored_pos(9, 2, 10) == 0  # the whole request: [0, 10)
    assert start_anchored_pos(9, 2, 3) == 0  # one row short: the trace's gap to handle
    with pytest.raises(EngineRoutesError, match=r"end at 11, past the 10 forwarded tokens"):
        start_anchored_pos(9, 2, 11)  # a row for the last token
    assert start_anchored_pos(9, 2, 11, last_token_row=True) == 0
    with pytest.raises(EngineRoutesError, match="past the 11 tokens"):
        start_anchored_pos(9, 2, 12, last_token_row=True)
    with pytest.raises(ConfigError, match=r"prompt_start: expected an int in \[0, 9\]"):
        start_anchored_pos(9, 2, 1, prompt_start=10)
    with pytest.raises(ConfigError, match="prompt_len"):
        start_anchored_pos(-1, 2, 1)


def test_anchored_pos_for_whole_responses():
    # lengths known: rows must end at the last forwarded token; a stated start must agree
    assert anchored_pos(6, 4, 3, None, what="w") == 0
    assert anchored_pos(4, 4, 3, 2, what="w") == 2
    with pytest.raises(EngineRoutesError, match=r"w: expected 4 route rows .* - 1 - start 2\), "):
        anchored_pos(5, 4, 3, 2, what="w")  # shifted by +1: a row for the last token
    with pytest.raises(EngineRoutesError, match="expected 4 route rows"):
        anchored_pos(3, 4, 3, 2, what="w")  # one row fewer
    with pytest.raises(EngineRoutesError, match="expected a start at most 6"):
        anchored_pos(0, 4, 3, 7, what="w")
    # lengths unknown: the start alone places the rows
    assert anchored_pos(5, None, 3, 2, what="w") == 2
    assert anchored_pos(5, 4, None, None, what="w") is None


def test_trace_re_exports_the_wire_rule():
    assert r3data.trace.end_anchored_pos is end_anchored_pos
    assert r3data.trace.start_anchored_pos is start_anchored_pos


@SETTINGS
@given(st.integers(0, 30), st.integers(0, 30), st.integers(0, 40), st.integers(0, 40))
def test_the_two_anchors_agree_on_whole_responses(prompt_len, completion_len, rows, start):
    """Rows ending at the last forwarded token sit where a start anchor puts them, and
    nowhere else: both fail exactly when the rows would cover the last token."""
    end = prompt_len + completion_len - 1
    if rows > max(end, 0):
        with pytest.raises(EngineRoutesError):
            end_anchored_pos(prompt_len, completion_len, rows)
        return
    pos = end_anchored_pos(prompt_len, completion_len, rows)
    assert pos + rows == max(end, 0)
    if pos <= prompt_len:
        assert start_anchored_pos(prompt_len, completion_len, rows, prompt_start=pos) == pos
    if start <= prompt_len:
        fits = start + rows <= max(end, 0)
        if fits:
            assert start_anchored_pos(prompt_len, completion_len, rows, start) == start
        else:
            with pytest.raises(EngineRoutesError):
                start_anchored_pos(prompt_len, completion_len, rows, start)


# --- every producer places rows by the same rule ---------------------------------------------


def _routes(rows: int) -> np.ndarray:
    return (np.arange(rows * 6).reshape(rows, 3, 2) % 7 + 1).astype(np.uint8)


def _vllm(routes, prompt_len, completion_len, start):
    buffer = io.BytesIO()
    np.save(buffer, routes)
    choice = {
        "prompt_token_ids": list(range(prompt_len)),
        "token_ids": list(range(completion_len)),
        "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
    }
    return vllm_routes({"choices": [choice]}, prompt_start=start)


def _sglang(routes, prompt_len, completion_len, start):
    meta = {
        "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode(),
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
    }
    return sglang_routes({"meta_info": meta}, num_layers=3, topk=2, start=start)


def _primerl(routes, prompt_len, completion_len, start):
    envelope = pack_ndarray(routes, start=start)
    return primerl_routes(
        {"choices": [{"routed_experts": envelope}]},
        prompt_len=prompt_len,
        completion_len=completion_len,
    )


PRODUCERS = {"vllm": _vllm, "sglang": _sglang, "prime-rl": _primerl}


@SETTINGS
@given(
    st.sampled_from(sorted(PRODUCERS)),
    st.integers(1, 12),
    st.integers(1, 6),
    st.data(),
)
def test_producers_place_rows_by_the_anchors(producer, prompt_len, completion_len, data):
    start = data.draw(st.integers(0, prompt_len))
    rows = prompt_len + completion_len - 1 - start
    (got,) = PRODUCERS[producer](_routes(rows), prompt_len, completion_len, start)
    assert got.pos == start == end_anchored_pos(prompt_len, completion_len, rows)
    assert got.pos == start_anchored_pos(prompt_len, completion_len, rows, start)
    assert got.end == prompt_len + completion_len - 1


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
@pytest.mark.parametrize("extra", [1, -1])
def test_producers_refuse_a_row_too_many_or_too_few(producer, extra):
    """A row for the never-forwarded last token (+1) or a missing one (-1) is an engine error."""
    prompt_len, completion_len, start = 5, 3, 2
    rows = prompt_len + completion_len - 1 - start + extra
    with pytest.raises(EngineRoutesError, match=rf"expected 5 route rows .*found {rows}"):
        PRODUCERS[producer](_routes(rows), prompt_len, completion_len, start)
