"""The one screen of ragged ids (sampling masks): whichever source a row came from (inline
CSR, inline rows padded with -1, a payload file's ragged or padded segment), a value that is no
token id (negative other than the -1 padding, or above int32) is refused by the fill, naming
the sample, its file and the token position, never handed to the trainer as a valid row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3data import loader
from r3data.errors import TraceError
from r3data.nodes import fill_field
from r3data.payload import PayloadReader, PayloadWriter
from r3data.ragged import MAX_TOKEN_ID, RaggedRows, first_bad_id
from r3data.trace import FieldInfo, StitchedField
from r3data.wire import InlineRows

MASK = "sampling_mask"
FIELDS = ("routed_experts", MASK)


def padded_rows(rows: list[list[int]], dtype=np.int32) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), -1, dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def mask_sources(kind: str, rows: list[list[int]], pos: int, writer: PayloadWriter | None):
    """The mask ``rows`` (one list of ids per token from ``pos``) as source ``kind`` sends
    them."""
    if kind == "csr":
        return [InlineRows(MASK, RaggedRows.from_rows(rows, np.int32), pos)]
    if kind == "padded":
        return [InlineRows(MASK, padded_rows(rows), pos)]
    if kind == "file-ragged":
        return writer.write(0, {MASK: [np.array(r, np.int32) for r in rows]}, pos=pos)
    return writer.write(0, {MASK: padded_rows(rows)}, pos=pos)  # file-padded (prime-rl)


KINDS = ("csr", "padded", "file-ragged", "file-padded")


def sample(name: str, kind: str, rows: list[list[int]], writer):
    prompt = 3
    n = prompt + len(rows)
    routes = np.ones((n - 1, 2, 2), np.uint8)
    sources = [InlineRows("routed_experts", routes, 0), *mask_sources(kind, rows, prompt, writer)]
    request = {"prompt_len": prompt, "completion_len": len(rows), "sources": sources}
    return {"id": name, "token_ids": np.arange(n), "requests": [request]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [-5, -2, -(2**31)])
def test_a_negative_id_is_refused_from_every_source(tmp_path, kind, bad):
    writer = PayloadWriter(tmp_path)
    good = sample("good", kind, [[4, 9], [1]], writer)
    hostile = sample("hostile", kind, [[2], [], [7, bad, 3]], writer)
    options = {"batch_size": 2, "prefetch": 0, "payload_root": tmp_path}
    where = r" in file \S+" if kind.startswith("file") else ""
    with pytest.raises(
        TraceError,
        match=rf"'hostile'.*{MASK}'{where}: expected token ids in "
        rf"\[0, {MAX_TOKEN_ID}\].*found {bad} at position 5",
    ):
        list(loader([good, hostile], collate={"fields": FIELDS, "workers": 1}, **options))


def test_the_padding_and_an_empty_row_stay_what_they_were(tmp_path):
    """-1 pads (never an id); a row with no ids is no mask there (not valid); duplicates are
    kept as sent, as on the wire (a mask row is a set: scattering it is unaffected)."""
    writer = PayloadWriter(tmp_path)
    rows = [[4, 4, 9], [], [0, MAX_TOKEN_ID]]
    samples = [sample(kind, kind, rows, writer) for kind in KINDS]
    options = {"batch_size": 4, "prefetch": 0, "payload_root": tmp_path}
    (batch,) = loader(samples, collate={"fields": FIELDS, "workers": 1}, **options)
    for i in range(len(KINDS)):
        got = batch[MASK].segment(i)
        assert [got[j : j + 1].compact()[0].tolist() for j in range(3, 6)] == rows
        assert batch[f"{MASK}_valid"][i].numpy()[3:6].tolist() == [True, False, True]


def test_an_id_above_int32_is_refused_in_a_wide_field():
    rows = RaggedRows.from_rows([[1, 2], [MAX_TOKEN_ID + 1]], np.int64)
    field = StitchedField(
        MASK, (InlineRows(MASK, rows, 4),), FieldInfo(np.dtype(np.int64), (), True), 2, None
    )
    with pytest.raises(TraceError, match=rf"found {MAX_TOKEN_ID + 1} at position 5"):
        fill_field(MASK, [field], dtype=np.dtype(np.int64))


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
)
def test_first_bad_id_in_every_integer_dtype(dtype):
    info = np.iinfo(dtype)
    values = np.array([0, 1, min(info.max, MAX_TOKEN_ID)], dtype)
    assert first_bad_id(values) is None
    if info.min < 0:
        assert first_bad_id(np.array([3, -1, 2, -1], dtype)) == 1
    if info.max > MAX_TOKEN_ID:
        assert first_bad_id(np.array([3, 2, MAX_TOKEN_ID + 1], dtype)) == 2
    assert first_bad_id(np.array([-1.5, 2.0])) is None  # floats are no ids: not screened


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(
        st.tuples(
            st.sampled_from(KINDS),
            st.lists(st.lists(st.integers(-4, 60), max_size=4), min_size=1, max_size=5),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_the_fill_refuses_exactly_the_first_bad_id_whatever_its_source(tmp_path_factory, requests):
    """Ids are drawn with -4..-1 among them (padded sources drop the -1s they send as ids:
    -1 pads); the fill refuses iff a value other than -1 is negative, naming the first one's
    position in the first sample holding one; otherwise every id lands as sent."""
    root = tmp_path_factory.mktemp("masks")
    writer = PayloadWriter(root)
    fields, expected, first_bad = [], [], None
    for index, (kind, rows) in enumerate(requests):
        if kind != "csr":  # -1 pads in padded forms; kept after a kept id it is a hole
            rows = [[v for v in r if v != -1] for r in rows]
        pieces = tuple(mask_sources(kind, rows, 2, writer))
        if kind == "padded":  # as the trace builder hands padded inline rows on
            pieces = (InlineRows(MASK, RaggedRows.from_padded(pieces[0].array), 2),)
        fields.append(
            StitchedField(MASK, pieces, FieldInfo(np.dtype(np.int32), (), True), len(rows), None)
        )
        expected.append(rows)
        if first_bad is None:
            flat = [(2 + t, v) for t, r in enumerate(rows) for v in r if v < 0]
            if flat:
                first_bad = (index, *flat[0])
    run = lambda: fill_field(MASK, fields, dtype=np.dtype(np.int32), reader=PayloadReader(root))  # noqa: E731
    if first_bad is not None:
        sample_index, position, value = first_bad
        with pytest.raises(TraceError, match=rf"found {value} at position {position}$") as caught:
            run()
        assert caught.value.r3data_sample == sample_index
        return
    filled = run()
    for index, rows in enumerate(expected):
        got = filled.values.segment(index)
        assert [got[j : j + 1].compact()[0].tolist() for j in range(len(rows))] == rows
