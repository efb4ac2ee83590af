"""The stitch against a first-principles reference, for random multi-turn traces.

Requests arrive in any order with any overlaps; each carries 0-2 disjoint sources per field
(routes, a fixed-width side field, a ragged mask), inline, still base64 or by handle, some
from a decode instance. The reference replays the documented rule position by position: a
later request's row wins, a decode source has no rows at its prompt positions; positions the
engine should have sent (every forwarded token for routes, every completion token for other
fields) and did not are a gap under ``on_gap``; the others are placeholders (the previous
valid row or distinct experts for routes, zeros or empty rows otherwise).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from trace_engine import materialized

sys.path.append(str(Path(__file__).resolve().parents[1] / "layout"))
from layout_reference import runs_of

from r3data.errors import TraceError, TraceGapError
from r3data.nodes import materialize
from r3data.payload.reader import PayloadReader
from r3data.payload.writer import PayloadWriter
from r3data.ragged import RaggedRows
from r3data.trace import TraceBuilder, distinct_row, stitch
from r3data.wire.anchors import routes_end
from r3data.wire.producers.common import array_base64
from r3data.wire.rows import EncodedRows, InlineRows

ROUTES, AUX, MASK = "routed_experts", "aux", "sampling_mask"
LAYERS, TOPK = 2, 2


def route_row(request: int, pos: int) -> np.ndarray:
    """Request ``request``'s route row at ``pos``: names both, never all zero."""
    return np.array([[request + 1, pos + 1], [pos % 7 + 1, request + 1]])


def aux_row(request: int, pos: int) -> np.ndarray:
    return np.array([request + 1, pos, -pos])


def mask_row(request: int, pos: int) -> np.ndarray:
    return np.arange((request + pos) % 3 + 1) + 10 * pos + request


ROWS = {ROUTES: route_row, AUX: aux_row, MASK: mask_row}


@st.composite
def traces(draw):
    """Requests ``(prompt_len, completion_len, [(field, lo, hi, dtype, form, role)])``."""
    requests, tokens = [], 0
    growing = draw(st.booleans())  # turns extending each other, or anything at all
    for _ in range(draw(st.integers(1, 4))):
        prompt = tokens + draw(st.integers(0, 4)) if growing else draw(st.integers(0, 10))
        completion = draw(st.integers(0, 5))
        tokens = prompt + completion
        last_token_row = draw(st.booleans())
        sources = []
        for name in (ROUTES, AUX, MASK):
            limit = (
                routes_end(prompt, completion, last_token_row=last_token_row)
                if name == ROUTES
                else prompt + completion
            )
            if draw(st.integers(0, 3)):  # the whole span the engine owes, from some start on
                first = 0 if name == ROUTES else min(prompt, limit)
                cuts = [draw(st.integers(0, first)), limit]
            else:
                cuts = sorted(draw(st.lists(st.integers(0, limit), max_size=4)))
            for lo, hi in zip(cuts[::2], cuts[1::2], strict=False):
                if hi > lo or draw(st.booleans()):  # empty sources too, now and then
                    dtype = draw(
                        st.sampled_from(
                            {ROUTES: ["uint8", "uint16", "int32"], AUX: ["int16", "int32"]}.get(
                                name, ["int32"]
                            )
                        )
                    )
                    forms = ["inline", "encoded", "handle"] if name != MASK else ["inline"]
                    form = draw(st.sampled_from(forms + (["padded"] if name == MASK else [])))
                    role = draw(st.sampled_from(["full", "full", "decode"]))
                    sources.append((name, lo, hi, dtype, form, role))
        requests.append((prompt, completion, last_token_row, sources))
    n = draw(st.one_of(st.integers(0, 18), st.just(max(p + c for p, c, *_ in requests))))
    return requests, n


def source_of(request, name, lo, hi, dtype, form, role, writer):
    meta = {"role": role}
    rows = [ROWS[name](request, p) for p in range(lo, hi)]
    if name == MASK:
        ragged = RaggedRows.from_rows([r.astype(dtype) for r in rows] or [], dtype=dtype)
        if form == "padded":
            return InlineRows(name, ragged.padded(), lo, meta)
        return InlineRows(name, ragged, lo, meta)
    shape = (LAYERS, TOPK) if name == ROUTES else (3,)
    array = np.array(rows, dtype=dtype).reshape(-1, *shape)
    if form == "encoded":
        return EncodedRows(
            name,
            array_base64(array),
            dtype=array.dtype,
            row_shape=shape,
            rows=hi - lo,
            pos=lo,
            meta=meta,
        )
    if form == "handle" and role == "full" and hi > lo:
        return writer.write(0, {name: array}, pos=lo)[0]
    return InlineRows(name, array, lo, meta)


def reference(requests, name, n, last_token_row):
    """Per position: the request whose row lands there (None: no row), and the gaps; the
    requests kept, ``(prompt_len, completion_len, number, sources)`` in arrival order; with
    ``last_token_row`` the engine owes a route row for each request's last token too."""
    owner: dict[int, int] = {}
    expected: set[int] = set()
    for prompt, completion, r, sources in requests:
        for field, lo, hi, *_, role in sources:
            if field == name:
                start = max(lo, prompt) if role == "decode" else lo
                owner.update((p, r) for p in range(start, hi))
        if name == ROUTES:
            expected.update(range(routes_end(prompt, completion, last_token_row=last_token_row)))
        else:
            expected.update(range(prompt, prompt + completion))
    return [owner.get(p) for p in range(n)], sorted(p for p in expected if p < n and p not in owner)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=traces(), placeholder=st.sampled_from(["repeat_previous", "distinct"]))
def test_every_position_gets_the_row_the_documented_rule_names(case, placeholder, tmp_path_factory):
    requests, n = case
    root = tmp_path_factory.mktemp("payload")
    writer, reader = PayloadWriter(root), PayloadReader(root, workers=1)
    last_token_row = requests[0][2]  # the trace's; other requests may pass it (refused)
    builder = TraceBuilder("t", last_token_row=last_token_row)
    kept = []
    for r, (prompt, completion, _, sources) in enumerate(requests):
        made = [source_of(r, *source, writer) for source in sources]
        passes_last = any(
            f == ROUTES
            and hi == prompt + completion
            and hi > routes_end(prompt, completion)
            and not dropped(prompt, lo, hi, role)
            for f, lo, hi, *_, role in sources
        )
        if passes_last and not last_token_row:
            with pytest.raises(TraceError, match="last token is never forwarded"):
                builder.add_request(prompt, completion, made)
            continue
        builder.add_request(prompt, completion, made)
        kept.append((prompt, completion, r, sources))
    trace = builder.build()
    assert [request[:2] for request in kept] == list(trace.requests)

    for name in (ROUTES, AUX, MASK):
        owner, gaps = reference(kept, name, n, last_token_row)
        event(
            f"{name}: {'gap' if gaps else 'no gap'}, {'rows' if any(o is not None for o in owner) else 'none'}"
        )
        if name not in trace.info:
            assert not surviving_dtypes(kept, name)
            continue
        if gaps:
            with pytest.raises(TraceGapError, match=rf"field '{name}': no rows for positions"):
                stitch(trace, n, fields=(name,), placeholder=placeholder, on_gap="raise")
            assert stitch(trace, n, fields=(name,), on_gap="drop_sample") is None
        sample = stitch(trace, n, fields=(name,), placeholder=placeholder)
        field = sample[name]
        got = materialized(sample, name, reader)
        assert len(got) == n
        assert field.valid.tolist() == [o is not None and not gaps for o in owner]
        assert sample.stats.rows_captured == (0 if gaps else sum(o is not None for o in owner))
        assert sample.stats.gaps == (len(runs_of(gaps)) if gaps else 0)
        assert field.dtype == np.result_type(*surviving_dtypes(kept, name))
        pieces = field.pieces
        assert [p.pos for p in pieces] == sorted(p.pos for p in pieces)
        assert sum(p.rows for p in pieces) == n
        assert all(a.end == b.pos for a, b in itertools.pairwise(pieces))
        previous = None
        for p, o in enumerate(owner):
            row = got[p]
            if o is not None and not gaps:
                want = ROWS[name](o, p)
                previous = want
            elif name == ROUTES:
                distinct = distinct_row((LAYERS, TOPK), np.dtype("uint8"))
                repeat = placeholder == "repeat_previous" and not gaps and previous is not None
                want = previous if repeat else distinct
            elif name == AUX:
                want = np.zeros(3)
            else:
                want = np.zeros(0)
            if name == MASK:
                row = row[row >= 0]
            np.testing.assert_array_equal(row, want, err_msg=f"{name} position {p}")


def surviving_dtypes(requests, name):
    """The dtypes of the sources of ``name`` the trace keeps (a decode source starting in the
    prompt and ending by its end is dropped whole)."""
    return [
        np.dtype(dtype)
        for prompt, _, _, sources in requests
        for field, lo, hi, dtype, _, role in sources
        if field == name and not dropped(prompt, lo, hi, role)
    ]


def dropped(prompt, lo, hi, role):
    """Whether the trace drops a source whole: a decode source's rows all in the prompt."""
    return role == "decode" and lo < prompt and hi <= prompt


def test_a_ragged_field_no_request_sent_is_int32_and_marked_unsent():
    """Its empty rows materialize as int32 ``RaggedRows`` (a uint8 form could not pad with -1:
    ``.padded()`` raised) and say they were not sent, so a batch's dtype ignores them."""
    trace = TraceBuilder("greedy")
    routes = np.ones((7, 2, 2), np.uint8)
    trace.add_request(4, 4, [InlineRows("routed_experts", routes, 0)])
    sample = stitch(trace, 8, fields=("routed_experts", "sampling_mask"))
    masks = sample["sampling_mask"]
    assert (masks.sent, masks.dtype, masks.ragged) == (False, np.dtype(np.int32), True)
    assert sample["routed_experts"].sent
    assert masks.with_pieces(masks.pieces).sent is False  # a rank-local cut keeps it
    rows = materialize(masks)
    assert (rows.rows, rows.values.dtype) == (8, np.dtype(np.int32))
    assert rows.padded().shape == (8, 0)
    assert not masks.valid.any()
