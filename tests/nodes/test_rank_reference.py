"""``r3data.loader`` against the first-principles reference of ``rank_reference``: for random
geometries (data-parallel sizes, micro-batch options, uneven sample counts, samples shorter
than a CP chunk, uncovered tokens, gaps, samples with no rows), sources (inline, base64, by
handle), shuffles, ``start_step`` and ``drop_last``, every rank receives exactly the samples,
rows, valid masks and rank-local routes the rules give, and a rank resumed from a state saved
after any micro-batch yields exactly the rest."""

from __future__ import annotations

import base64
import tempfile

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rank_reference import (
    TOPK,
    SampleSpec,
    expanded,
    local_positions,
    rank_micro_batches,
    route_row,
    runs_of,
)
from source_kinds import SOURCES

from r3data import loader
from r3data.layout import TokenLayout, expand
from r3data.nodes import DataParallel, MicroBatches, Shuffle
from r3data.payload import PayloadWriter
from r3data.wire import EncodedRows, InlineRows

EXPERTS = 256


"""Every kind of source the loader takes, resumable."""


def make_sample(spec: SampleSpec, kind: str, writer: PayloadWriter | None) -> dict:
    """The sample ``spec`` describes, its rows from ``kind`` sources (one per run of rows)."""
    sources = []
    for lo, hi in runs_of(spec.engine_positions()):
        rows = np.array([[route_row(spec.index, p)] for p in range(lo, hi)], np.uint8)
        if kind == "inline":
            sources.append(InlineRows("routed_experts", rows, lo))
        elif kind == "base64":
            data = base64.b64encode(rows.tobytes()).decode()
            sources.append(
                EncodedRows(
                    "routed_experts",
                    data,
                    dtype=np.uint8,
                    row_shape=(1, TOPK),
                    rows=hi - lo,
                    pos=lo,
                )
            )
        else:
            (segment,) = writer.write(0, {"routed_experts": rows}, pos=lo)
            sources.append(segment.to_dict())
    prompt = spec.covered // 2
    request = {"prompt_len": prompt, "completion_len": spec.covered - prompt, "sources": sources}
    return {"id": f"s{spec.index}", "token_ids": np.arange(spec.n) + 7, "requests": [request]}


@st.composite
def sample_specs(draw, index: int) -> SampleSpec:
    n = draw(st.integers(1, 14))
    covered = draw(st.integers(1, n + 2))  # more than n: token_ids cut the trace
    hole = None
    window = min(covered - 1, n)  # the rows inside the sample
    if window > 2 and draw(st.integers(0, 5)) == 0:  # a gap the engine left
        lo = draw(st.integers(1, window - 2))
        hole = (lo, draw(st.integers(lo + 1, window - 1)))
    return SampleSpec(index, n, covered, hole)


@st.composite
def cases(draw):
    dp = draw(st.integers(1, 3))
    count = draw(st.integers(0, 9))
    specs = [draw(sample_specs(i)) for i in range(count)]
    micro = draw(
        st.sampled_from([None, ("size", 1), ("size", 2), ("max_tokens", 14), ("max_tokens", 30)])
    )
    options = {
        "batch_size": dp * draw(st.integers(1, 3)),
        "micro": micro,
        "shuffle": draw(st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 2)))),
        "drop_last": draw(st.booleans()),
        "start_step": draw(st.integers(0, 3)),
        "placeholder": draw(st.sampled_from(["repeat_previous", "distinct"])),
    }
    layout = None
    if draw(st.booleans()):
        cp, tp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        sp = tp > 1 and draw(st.booleans())
        packed = draw(st.booleans())
        need = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
        layout = TokenLayout(
            cp_size=cp,
            cp_rank=draw(st.integers(0, cp - 1)),
            tp_size=tp,
            tp_rank=draw(st.integers(0, tp - 1)),
            sequence_parallel=sp,
            packed=packed,
            padding_side="right" if packed else draw(st.sampled_from(["left", "right"])),
            pad_multiple=draw(st.sampled_from([None, 2 * need])),
            seq_length=None if packed else draw(st.sampled_from([None, 16])),
        )
    kinds = [draw(st.sampled_from(["inline", "base64", "handle"])) for _ in specs]
    source = draw(st.sampled_from(sorted(SOURCES)))
    if source != "list":  # only a map-style source is shuffled
        options["shuffle"] = None
    return dp, draw(st.integers(0, dp - 1)), specs, kinds, options, layout, source


def loader_options(dp, rank, options, layout, root):
    micro = options["micro"]
    shuffle = options["shuffle"]
    return {
        "batch_size": options["batch_size"],
        "data_parallel": DataParallel(rank=rank, size=dp),
        "micro_batches": None if micro is None else MicroBatches(**{micro[0]: micro[1]}),
        "shuffle": None if shuffle is None else Shuffle(seed=shuffle[0], epoch=shuffle[1]),
        "drop_last": options["drop_last"],
        "start_step": options["start_step"],
        "num_experts": EXPERTS,
        "layout": layout,
        "payload_root": root,
        "trace": {"placeholder": options["placeholder"], "length_mismatch": "ignore"},
        "collate": {"workers": 1},
    }


def check_batch(batch, want, specs, layout, placeholder) -> None:
    step, number, count, indices, step_indices = want
    meta = batch.metadata
    assert (meta["step"], meta["micro_batch"], meta["micro_batches"]) == (step, number, count)
    kept = [i for i in indices if not specs[i].dropped()]
    assert batch["sample_id"] == [f"s{i}" for i in kept]
    assert list(meta["index"]) == kept
    assert meta["dropped"] == [f"s{i}" for i in indices if specs[i].dropped()]
    lengths = [specs[i].n for i in kept]
    full_rows, full_valid = [], []
    for i in kept:
        rows, valid = specs[i].rows(placeholder)
        full_rows.append(rows)
        full_valid.append(valid)
        assert batch["token_ids"][len(full_rows) - 1].tolist() == list(range(7, 7 + specs[i].n))
    routes, valid = batch["routed_experts"], batch["routed_experts_valid"]
    if layout is None:
        positions = [list(range(n)) for n in lengths]
    else:
        positions = local_positions(layout, lengths)
        assert routes.layout == layout
        assert routes.full_lengths.tolist() == lengths
    assert routes.lengths.tolist() == [len(p) for p in positions]
    for b, sample_positions in enumerate(positions):
        assert routes[b].tolist() == [[full_rows[b][p]] for p in sample_positions], kept[b]
        assert valid[b].tolist() == [full_valid[b][p] for p in sample_positions], kept[b]
    # an empty micro-batch (a rank short of samples) keeps the row shape: its forward runs;
    # only a step with no row at all has none to keep
    formed = any(not specs[i].dropped() for i in step_indices)
    if formed:
        assert routes.row_shape == (1, TOPK)
    if layout is not None and formed:
        packed = [row for rows in full_rows for row in rows]
        (got,) = expand(routes)  # one layer
        assert got.tolist() == expanded(layout, lengths, packed)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases(), cut=st.integers(0, 8))
@example(  # samples shorter than a CP chunk, a rank whose share is empty, by handle
    case=(
        3,
        2,
        [SampleSpec(0, 1, 1), SampleSpec(1, 2, 2), SampleSpec(2, 3, 3), SampleSpec(3, 9, 9)],
        ["handle", "inline", "base64", "handle"],
        {
            "batch_size": 3,
            "micro": ("max_tokens", 14),
            "shuffle": (1, 0),
            "drop_last": False,
            "start_step": 2,
            "placeholder": "repeat_previous",
        },
        TokenLayout(cp_size=2, cp_rank=1, tp_size=2, tp_rank=1, sequence_parallel=True),
        "list",
    ),
    cut=2,
)
def test_every_rank_gets_the_reference_rows_and_resumes_to_them(case, cut):
    dp, rank, specs, kinds, options, layout, source = case
    shuffle = options["shuffle"]
    order = (
        list(range(len(specs)))
        if shuffle is None
        else np.random.Generator(np.random.PCG64(list(shuffle))).permutation(len(specs)).tolist()
    )
    want = rank_micro_batches(
        specs,
        batch_size=options["batch_size"],
        dp=dp,
        rank=rank,
        micro=options["micro"],
        order=order,
        drop_last=options["drop_last"],
        start_step=options["start_step"],
    )
    with tempfile.TemporaryDirectory() as root:
        writer = PayloadWriter(root)
        samples = [make_sample(s, k, writer) for s, k in zip(specs, kinds, strict=True)]
        kwargs = loader_options(dp, rank, options, layout, root)
        make = SOURCES[source]
        got = list(loader(make(samples), prefetch=1, **kwargs))
        assert len(got) == len(want)
        for batch, expected in zip(got, want, strict=True):
            check_batch(batch, expected, specs, layout, options["placeholder"])
        cut = min(cut, len(got))
        first = loader(make(samples), prefetch=2, **kwargs)
        it = iter(first)
        for _ in range(cut):
            next(it)
        resumed = loader(make(samples), prefetch=0, **kwargs)
        resumed.load_state_dict(first.state_dict())
        rest = list(resumed)
    assert len(rest) == len(got) - cut
    for a, b in zip(rest, got[cut:], strict=True):
        assert a == b
