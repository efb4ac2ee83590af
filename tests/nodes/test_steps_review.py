"""Steps, data-parallel shares and micro-batches through the whole loader, for random data:
every sample reaches exactly one rank exactly once, with its own rows, in the same plan
whatever kind of source holds the samples, and a rank resumed anywhere reads exactly the rest.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from source_kinds import SOURCES as KINDS

from r3data import loader
from r3data.errors import ConfigError
from r3data.nodes import DataParallel, MicroBatches, Shuffle, plan_step
from r3data.wire import InlineRows

LAYERS, TOPK = 1, 2


def make_samples(lengths):
    """Samples whose every row names the sample (ids from 1: never an all-zero row)."""
    samples = []
    for i, n in enumerate(lengths):
        rows = np.full((n - 1, LAYERS, TOPK), i + 1, np.uint8)
        request = {"prompt_len": 1, "completion_len": n - 1}
        request["sources"] = [InlineRows("routed_experts", rows, 0)]
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    return samples


SOURCES = {kind: KINDS[kind] for kind in ("list", "re-iterable", "node")}


@st.composite
def plans(draw):
    dp = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(2, 12), min_size=0, max_size=10))
    batch_size = dp * draw(st.integers(1, 3))
    micro = draw(
        st.sampled_from(
            [None, MicroBatches(size=1), MicroBatches(size=2), MicroBatches(max_tokens=24)]
        )
    )
    return dp, lengths, batch_size, micro, draw(st.booleans()), draw(st.integers(0, 5))


def rank_batches(make, samples, dp, rank, **options):
    return list(
        loader(
            make(samples),
            data_parallel=DataParallel(rank=rank, size=dp),
            prefetch=0,
            collate={"workers": 1},
            **options,
        )
    )


@settings(max_examples=20, deadline=None)
@given(case=plans(), kind=st.sampled_from(sorted(SOURCES)))
def test_every_sample_reaches_one_rank_once_with_its_rows(case, kind):
    dp, lengths, batch_size, micro, drop_last, start_step = case
    samples = make_samples(lengths)
    options = {
        "batch_size": batch_size,
        "micro_batches": micro,
        "drop_last": drop_last,
        "start_step": start_step,
    }
    ranks = [rank_batches(SOURCES[kind], samples, dp, r, **options) for r in range(dp)]
    reference = [rank_batches(SOURCES["list"], samples, dp, r, **options) for r in range(dp)]
    assert ranks == reference  # the source's kind changes nothing
    steps = len(lengths) // batch_size if drop_last else -(-len(lengths) // batch_size)
    seen = []
    for batches in ranks:
        assert [b.metadata["step"] for b in batches] == sorted(b.metadata["step"] for b in batches)
        by_step: dict[int, list] = {}
        for b in batches:
            by_step.setdefault(b.metadata["step"], []).append(b)
        assert sorted(by_step) == list(range(start_step, start_step + steps))
        for step, micro_batches in by_step.items():
            counts = {b.metadata["micro_batches"] for b in micro_batches}
            assert counts == {len(micro_batches)}
            assert [b.metadata["micro_batch"] for b in micro_batches] == list(
                range(len(micro_batches))
            )
            # as many micro-batches on every rank of the step
            assert {len([b for b in r if b.metadata["step"] == step]) for r in ranks} == {
                len(micro_batches)
            }
            for b in micro_batches:
                if micro is not None and micro.max_tokens:
                    assert b["token_ids"].total_rows <= micro.max_tokens
                for k, (sid, index) in enumerate(
                    zip(b["sample_id"], b.metadata["index"], strict=True)
                ):
                    assert sid == f"s{index}"
                    assert index // batch_size + start_step == step  # its own step
                    routes = b["routed_experts"][k].numpy()
                    assert (routes[: lengths[index] - 1] == index + 1).all()
                    seen.append(index)
    kept = steps * batch_size if drop_last else len(lengths)
    assert sorted(seen) == list(range(kept))


@settings(max_examples=10, deadline=None)
@given(case=plans(), cut=st.integers(0, 12), seed=st.integers(0, 3))
def test_a_rank_resumed_after_any_micro_batch_reads_exactly_the_rest(case, cut, seed):
    dp, lengths, batch_size, micro, drop_last, start_step = case
    samples = make_samples(lengths)
    rank = seed % dp
    options = {
        "batch_size": batch_size,
        "micro_batches": micro,
        "drop_last": drop_last,
        "start_step": start_step,
        "shuffle": Shuffle(seed=seed),
        "data_parallel": DataParallel(rank=rank, size=dp),
        "collate": {"workers": 1},
    }
    full = list(loader(samples, prefetch=1, **options))
    cut = min(cut, len(full))
    first = loader(samples, prefetch=1, **options)
    it = iter(first)
    for _ in range(cut):
        next(it)
    resumed = loader(samples, prefetch=0, **options)  # another depth: the same state
    resumed.load_state_dict(first.state_dict())
    assert list(resumed) == full[cut:]


def test_one_sample_over_the_token_budget_is_refused_naming_it():
    with pytest.raises(
        ConfigError, match=r"max_tokens=8: the sample at position 1 of the step has 9"
    ):
        plan_step([3, 9, 2], 2, MicroBatches(max_tokens=8))
    assert plan_step([3, 8, 2], 2, MicroBatches(max_tokens=8)) == [[[1]], [[0, 2]]]
    batches = loader(make_samples([3, 9, 2, 4]), batch_size=2, micro_batches={"max_tokens": 8})
    with pytest.raises(ConfigError, match="the sample at position 1 of the step has 9 tokens"):
        list(batches)


def test_more_ranks_than_samples_get_empty_micro_batches_in_step():
    samples = make_samples([5, 7, 9])
    ranks = [
        rank_batches(SOURCES["list"], samples, 4, r, batch_size=4, micro_batches={"size": 1})
        for r in range(4)
    ]
    assert [[b["sample_id"] for b in r] for r in ranks] == [[["s2"]], [["s1"]], [["s0"]], [[]]]
    assert all(r[0].metadata["micro_batches"] == 1 for r in ranks)


def _state_after(yielded: int, **options):
    first = loader(make_samples([4, 5, 6, 7, 8, 9, 10, 11]), collate={"workers": 1}, **options)
    it = iter(first)
    for _ in range(yielded):
        next(it)
    return first.state_dict()


BASE = {"batch_size": 4, "micro_batches": {"size": 1}, "shuffle": Shuffle(seed=1)}


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"batch_size": 2}, "batch_size=4, found batch_size=2"),
        ({"shuffle": Shuffle(seed=2)}, r"shuffle=\[1, 0\], found shuffle=\[2, 0\]"),
        ({"shuffle": None}, r"shuffle=\[1, 0\], found shuffle=None"),
        ({"start_step": 5}, "start_step=0, found start_step=5"),
        ({"micro_batches": {"size": 2}}, r"micro_batches=\[1, None\], found micro_batches=\[2"),
        (
            {"data_parallel": DataParallel(rank=1, size=2)},
            "dp_size=1, found dp_size=2",
        ),
    ],
)
def test_a_state_resumes_only_a_loader_that_plans_alike(changed, message):
    """A saved step and micro-batch index mean something only under the same plan: another
    batch size, order or (inside a step) share would skip or repeat samples silently."""
    state = _state_after(1, **BASE)  # inside step 0: micro-batch 1 of 4 is next
    resumed = loader(make_samples([4, 5, 6, 7, 8, 9, 10, 11]), **{**BASE, **changed})
    with pytest.raises(ConfigError, match=rf"cannot resume: the state was saved .*{message}"):
        resumed.load_state_dict(state)  # refused when loaded, before any pass


def test_at_a_step_boundary_the_shares_and_micro_batches_may_change():
    state = _state_after(4, **BASE)  # step 0 done
    options = {**BASE, "micro_batches": {"max_tokens": 100}}
    rest = [
        sid
        for rank in range(2)
        for b in _resumed(state, data_parallel=DataParallel(rank=rank, size=2), **options)
        for sid in b["sample_id"]
    ]
    order = Shuffle(seed=1).order(8).tolist()
    assert sorted(rest) == sorted(f"s{i}" for i in order[4:])  # step 1's samples, once


def _resumed(state, **options):
    resumed = loader(make_samples([4, 5, 6, 7, 8, 9, 10, 11]), collate={"workers": 1}, **options)
    resumed.load_state_dict(state)
    return list(resumed)


@pytest.mark.parametrize(("saved", "loaded"), [(0, 2), (2, 0), (1, 3)])
def test_a_state_saved_with_one_prefetch_depth_resumes_another(saved, loaded):
    options = {"batch_size": 2, "micro_batches": {"size": 1}, "collate": {"workers": 1}}
    samples = make_samples([4, 5, 6, 7, 8, 9])
    full = list(loader(samples, prefetch=0, **options))
    for cut in range(len(full) + 1):
        first = loader(samples, prefetch=saved, **options)
        it = iter(first)
        for _ in range(cut):
            next(it)
        resumed = loader(samples, prefetch=loaded, **options)
        resumed.load_state_dict(first.state_dict())
        assert list(resumed) == full[cut:], cut
