"""Optimizer steps, data-parallel shares and micro-batches: plans, the loader, resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

from r3data import TensorBatch, loader
from r3data.errors import ConfigError
from r3data.nodes import DataParallel, MicroBatches, Shuffle, plan_step
from r3data.wire import InlineRows

LAYERS, TOPK, EXPERTS = 2, 2, 16


def make_samples(lengths, seed=0):
    """Inline samples whose routes identify them (row ids depend on the sample)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        rows = rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.uint8)
        request = {"prompt_len": 1, "completion_len": n - 1}
        request["sources"] = [InlineRows("routed_experts", rows, 0)]
        samples.append({"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]})
    return samples


def run(samples, **options) -> list[TensorBatch]:
    return list(loader(samples, collate={"workers": 1}, **options))


# --- the plan ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    dp=st.integers(1, 4),
    budget=st.one_of(st.none(), st.integers(50, 200)),
    size=st.integers(1, 5),
)
@example(lengths=[1] * 8 + [3], dp=4, budget=None, size=1)  # the long one alone, 3 on others
def test_a_plan_splits_every_step_into_disjoint_balanced_equal_counts(lengths, dp, budget, size):
    micro = MicroBatches(max_tokens=budget) if budget else MicroBatches(size=size)
    plan = plan_step(lengths, dp, micro)
    assert plan == plan_step(lengths, dp, micro)  # deterministic: every rank computes it
    assert len(plan) == dp
    every = sorted(p for rank in plan for m in rank for p in m)
    assert every == list(range(len(lengths)))  # disjoint and complete
    assert len({len(rank) for rank in plan}) == 1  # as many micro-batches on every rank
    shares = [sum(len(m) for m in rank) for rank in plan]
    assert max(shares) - min(shares) <= 1
    tokens = [sum(lengths[p] for m in rank for p in m) for rank in plan]
    assert max(tokens) - min(tokens) <= max(lengths)  # balanced by tokens
    for rank in plan:
        for m in rank:
            assert m == sorted(m)
            if budget:
                assert sum(lengths[p] for p in m) <= budget
            else:
                assert len(m) <= size


def test_a_token_budget_uses_as_few_micro_batches_as_fit():
    plan = plan_step([10, 10, 10, 10, 30, 30, 30, 30], 2, MicroBatches(max_tokens=40))
    assert [len(rank) for rank in plan] == [2, 2]
    assert all(sum([10, 10, 10, 10, 30, 30, 30, 30][p] for p in m) <= 40 for r in plan for m in r)
    with pytest.raises(ConfigError, match="has 30 tokens, more than one micro-batch may hold"):
        plan_step([5, 30], 1, MicroBatches(max_tokens=29))


def test_option_objects_refuse_bad_values():
    with pytest.raises(ConfigError, match="exactly one of size or max_tokens"):
        MicroBatches()
    with pytest.raises(ConfigError, match="exactly one of size or max_tokens"):
        MicroBatches(size=2, max_tokens=10)
    with pytest.raises(ConfigError, match=r"DataParallel.rank: expected an int in \[0, 1\]"):
        DataParallel(rank=2, size=2)
    with pytest.raises(ConfigError, match="not initialised"):
        DataParallel.from_torch()
    with pytest.raises(ConfigError, match="multiple of the 3 data-parallel ranks"):
        loader([], batch_size=4, data_parallel=DataParallel(rank=0, size=3))
    with pytest.raises(ConfigError, match="shuffle needs a map-style source"):
        loader(iter([]), batch_size=1, shuffle=True)


# --- the loader ----------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [None, MicroBatches(size=2), MicroBatches(max_tokens=60)])
def test_data_parallel_ranks_share_every_step_disjointly(micro):
    lengths = [5, 30, 12, 8, 20, 3, 17, 9, 25, 4, 11]
    samples = make_samples(lengths)
    (whole,) = run(samples, batch_size=len(samples))
    by_id = {sid: whole[i : i + 1] for i, sid in enumerate(whole["sample_id"])}
    ranks = [
        run(samples, batch_size=4, data_parallel=DataParallel(rank=r, size=2), micro_batches=micro)
        for r in range(2)
    ]
    seen = []
    for steps in zip(*[_by_step(r) for r in ranks], strict=True):
        assert len({len(s) for s in steps}) == 1  # as many micro-batches on both ranks
        step_tokens = []
        for micro_batches in steps:
            step_tokens.append(sum(int(m["token_ids"].total_rows) for m in micro_batches))
            for k, m in enumerate(micro_batches):
                assert (m.metadata["micro_batch"], m.metadata["micro_batches"]) == (
                    k,
                    len(micro_batches),
                )
                if micro is not None and micro.max_tokens:
                    assert m["token_ids"].total_rows <= micro.max_tokens
                for b, sid in enumerate(m["sample_id"]):  # the same bytes as a single rank's
                    assert torch.equal(m["routed_experts"][b], by_id[sid]["routed_experts"][0])
                seen += m["sample_id"]
        assert abs(step_tokens[0] - step_tokens[1]) <= max(lengths)
    assert sorted(seen) == sorted(whole["sample_id"])  # every sample once, on one rank


def _by_step(batches):
    steps: dict[int, list[TensorBatch]] = {}
    for b in batches:
        steps.setdefault(b.metadata["step"], []).append(b)
    return [steps[s] for s in sorted(steps)]


def test_steps_are_numbered_from_start_step_and_a_short_last_step_can_be_dropped():
    samples = make_samples([4] * 7)
    kept = run(samples, batch_size=3, start_step=10)
    assert [b.metadata["step"] for b in kept] == [10, 11, 12]
    assert [b.batch_size for b in kept] == [3, 3, 1]
    dropped = run(samples, batch_size=3, drop_last=True)
    assert [b.batch_size for b in dropped] == [3, 3]


def test_shuffle_is_a_permutation_fixed_by_seed_and_epoch():
    samples = make_samples([4] * 12)

    def order(**shuffle):
        return [
            i
            for b in run(samples, batch_size=4, shuffle=Shuffle(**shuffle))
            for i in b.metadata["index"]
        ]

    first = order(seed=1, epoch=0)
    assert sorted(first) == list(range(12))
    assert first == order(seed=1, epoch=0)
    assert first != order(seed=1, epoch=1)
    assert first != order(seed=2, epoch=0)
    plain = [i for b in run(samples, batch_size=4, shuffle=False) for i in b.metadata["index"]]
    assert plain == list(range(12))


def _resumes_exactly(make_source, cut_every=True, **options):
    full = run(make_source(), **options)
    for cut in range(len(full) + 1) if cut_every else (len(full) // 2,):
        first = loader(make_source(), collate={"workers": 1}, **options)
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = first.state_dict()
        resumed = loader(make_source(), collate={"workers": 1}, **options)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(rest) == len(full) - cut, cut
        for got, want in zip(rest, full[cut:], strict=True):
            assert got == want


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_each_rank_resumes_at_every_micro_batch(rank, prefetch):
    samples = make_samples([5, 30, 12, 8, 20, 3, 17, 9, 25, 4, 11, 6])
    _resumes_exactly(
        lambda: samples,
        batch_size=6,
        data_parallel=DataParallel(rank=rank, size=2),
        micro_batches=MicroBatches(max_tokens=40),
        shuffle=Shuffle(seed=3, epoch=1),
        prefetch=prefetch,
    )


def test_a_torchdata_node_source_nests_its_state_and_resumes():
    samples = make_samples([6, 9, 4, 12, 7, 5, 8])
    _resumes_exactly(
        lambda: IterableWrapper(samples), batch_size=2, micro_batches=MicroBatches(size=1)
    )


def test_a_stateful_iterable_source_nests_its_state_and_resumes():
    samples = make_samples([6, 9, 4, 12, 7, 5, 8])

    def source():  # e.g. a StatefulDataLoader over the rollouts of an RL step
        return StatefulDataLoader(samples, batch_size=None, collate_fn=lambda sample: sample)

    _resumes_exactly(source, cut_every=False, batch_size=3)


def test_a_generator_cannot_resume_but_a_re_iterable_can():
    samples = make_samples([5, 6, 7, 8])

    class Again:
        def __iter__(self):
            return iter(samples)

    _resumes_exactly(Again, batch_size=2)
    first = loader((s for s in samples), batch_size=2)
    next(iter(first))
    state = first.state_dict()
    resumed = loader((s for s in samples), batch_size=2)
    with pytest.raises(ConfigError, match="cannot resume at step 1: the samples are a one-shot"):
        resumed.load_state_dict(state)
