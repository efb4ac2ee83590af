"""A loader's ``state_dict`` is checked when loaded: every state the loader saves resumes exactly
the remaining micro-batches, and an edited one (a wrong type, a negative or out-of-range step,
micro-batch or fast-forward, a layer that is no dict) is a ``ConfigError`` naming the key, what
was expected and what was found, never samples repeated, skipped or started over silently."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from source_kinds import SOURCES
from test_loader_steps import make_samples as steps_samples

from r3data import loader
from r3data.errors import ConfigError
from r3data.nodes import DataParallel, MicroBatches, StepSource

SOURCE = "state['root']['snapshot']['it_state']['source']"


def make_samples(lengths):
    return steps_samples(lengths, seed=len(lengths))


def make(samples, kind="list", **options):
    options = {"batch_size": 2, "collate": {"workers": 1}, **options}
    return loader(SOURCES[kind](samples), **options)


def signature(batch) -> tuple:
    return (batch.metadata["step"], batch.metadata["micro_batch"], tuple(batch["sample_id"]))


def saved_after(cut, samples, kind="list", **options):
    """The state a loader saves after ``cut`` micro-batches."""
    first = make(samples, kind, **options)
    it = iter(first)
    for _ in range(cut):
        next(it)
    return first.state_dict()


def resumed(state, samples, kind="list", **options) -> list[tuple]:
    again = make(samples, kind, **options)
    again.load_state_dict(state)
    return [signature(b) for b in again]


def source_state(state):
    return state["root"]["snapshot"]["it_state"]["source"]


def edited(state, change):
    state = copy.deepcopy(state)
    change(state)
    return state


# --- every real state resumes; edited ones are refused -------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.integers(max_value=-1),
)
"""Values no count of a state may take (a bool is no int, however Python sees it)."""


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 30), min_size=1, max_size=9),
    kind=st.sampled_from(sorted(SOURCES)),
    dp=st.sampled_from([1, 2]),
    micro=st.sampled_from([None, MicroBatches(size=1), MicroBatches(max_tokens=40)]),
    drop_last=st.booleans(),
    prefetch=st.sampled_from([0, 2]),
    data=st.data(),
)
def test_every_saved_state_resumes_exactly_and_every_edit_of_it_is_refused(
    lengths, kind, dp, micro, drop_last, prefetch, data
):
    samples = make_samples(lengths)
    options = {
        "batch_size": 2 * dp,
        "data_parallel": DataParallel(rank=data.draw(st.integers(0, dp - 1)), size=dp),
        "micro_batches": micro,
        "drop_last": drop_last,
        "prefetch": prefetch,
    }
    every = [signature(b) for b in make(samples, kind, **options)]
    cut = data.draw(st.integers(0, len(every)), label="cut")
    state = saved_after(cut, samples, kind, **options)
    assert resumed(state, samples, kind, **options) == every[cut:]

    key = data.draw(st.sampled_from(["step", "micro_batch", "ended", "plan", "steps"]))
    if key == "plan":
        bad = data.draw(st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2)))
    elif key == "ended":  # no bool: either is a state's
        bad = data.draw(JUNK.filter(lambda value: not isinstance(value, bool)))
    else:
        bad = data.draw(JUNK)
    if key in ("step", "micro_batch") and kind == "list":  # past the end of the data
        bad = data.draw(st.one_of(st.just(bad), st.integers(10**6, 10**30)))
    if key == "micro_batch":  # past any step's micro-batches, or resumed inside no step
        bad = data.draw(st.one_of(st.just(bad), st.integers(10**6, 10**30)))
    if key == "steps":  # fast-forwarded past the end
        bad = data.draw(st.one_of(st.just(bad), st.integers(len(every) - cut + 1, 10**6)))

    def change(state):
        if key == "steps":
            state["root"]["steps_since_snapshot"] = bad
        else:
            source_state(state)[key] = bad

    name = "steps_since_snapshot" if key == "steps" else key
    with pytest.raises(ConfigError, match=rf"\['{name}'\]: expected .*, found "):
        resumed(edited(state, change), samples, kind, **options)


IDS = [
    "step=-1",
    "step=True",
    "step='1'",
    "step=1.5",
    "step=10**30",
    "micro_batch=-1",
    "micro_batch=None",
    "micro_batch=5",
    "micro_batch at the end",
    "ended='yes'",
    "plan=None",
    "source=None",
    "it_state=None",
    "snapshot=[]",
    "steps_since_snapshot=-3",
    "steps_since_snapshot=3",
]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: source_state(s).update(step=-1), "['step']: expected an int >= 0, found -1"),
        (lambda s: source_state(s).update(step=True), "['step']: expected an int >= 0, found True"),
        (lambda s: source_state(s).update(step="1"), "['step']: expected an int >= 0, found '1'"),
        (lambda s: source_state(s).update(step=1.5), "['step']: expected an int >= 0, found 1.5"),
        (
            lambda s: source_state(s).update(step=10**30),
            "['step']: expected at most 3 (the end of 6 samples in steps of 2), found 1000",
        ),
        (
            lambda s: source_state(s).update(micro_batch=-1),
            "['micro_batch']: expected an int >= 0, found -1",
        ),
        (
            lambda s: source_state(s).update(micro_batch=None),
            "['micro_batch']: expected an int >= 0, found None",
        ),
        (
            lambda s: source_state(s).update(micro_batch=5),
            "['micro_batch']: expected at most 1 (the micro-batches of step 1 on this rank), "
            "found 5",
        ),
        (
            lambda s: source_state(s).update(step=3, micro_batch=1),
            "['micro_batch']: expected 0 at the end of the data (step 3 has no samples), found 1",
        ),
        (lambda s: source_state(s).update(ended="yes"), "['ended']: expected a bool, found 'yes'"),
        (lambda s: source_state(s).update(plan=None), "['plan']: expected a dict of the options"),
        (
            lambda s: s["root"]["snapshot"]["it_state"].update(source=None),
            f"{SOURCE}: expected a dict, found None",
        ),
        (
            lambda s: s["root"]["snapshot"].update(it_state=None),
            "state['root']['snapshot']['it_state']: expected a dict, found None",
        ),
        (
            lambda s: s["root"].update(snapshot=[]),
            "state['root']['snapshot']: expected a dict, found []",
        ),
        (
            lambda s: s["root"].update(steps_since_snapshot=-3),
            "state['root']['steps_since_snapshot']: expected an int >= 0, found -3",
        ),
        (
            lambda s: s["root"].update(steps_since_snapshot=3),
            "state['root']['steps_since_snapshot']: expected at most 2 (the micro-batches left "
            "after the snapshot), found 3",
        ),
    ],
    ids=IDS,
)
def test_an_edited_state_is_refused_naming_the_key_the_expected_and_the_found(
    change, message, prefetch
):
    samples = make_samples([5] * 6)
    state = saved_after(1, samples, prefetch=prefetch)
    with pytest.raises(ConfigError) as error:
        resumed(edited(state, change), samples, prefetch=prefetch)
    # a key of the source's own state is named where it lies in the loader's
    assert (SOURCE + message if message.startswith("[") else message) in str(error.value)


# --- the edges a valid state may sit on ----------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_micro_batch_equal_to_the_count_resumes_after_the_steps_last(prefetch):
    samples = make_samples([5, 9, 4, 12, 7, 5, 8, 6])
    options = {"batch_size": 4, "micro_batches": MicroBatches(size=1), "prefetch": prefetch}
    every = [signature(b) for b in make(samples, **options)]
    assert [m for _, m, _ in every] == [0, 1, 2, 3] * 2
    state = saved_after(1, samples, **options)  # inside step 0, after micro-batch 0
    assert source_state(state)["micro_batch"] == 1
    assert resumed(state, samples, **options) == every[1:]
    after_last = edited(state, lambda s: source_state(s).update(micro_batch=4))
    assert resumed(after_last, samples, **options) == every[4:]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_map_style_source_resumes_at_its_end_but_refuses_a_step_past_it(drop_last):
    samples = make_samples([5] * 7)  # 4 steps of 2, the last short
    end = saved_after(len(list(make(samples, drop_last=drop_last))), samples, drop_last=drop_last)
    assert resumed(end, samples, drop_last=drop_last) == []
    at_end = edited(end, lambda s: source_state(s).update(step=4))
    assert resumed(at_end, samples, drop_last=drop_last) == []  # a stream ended there too
    past = edited(end, lambda s: source_state(s).update(step=5))
    with pytest.raises(ConfigError, match=r"\['step'\]: expected at most 4 .*, found 5"):
        resumed(past, samples, drop_last=drop_last)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_state_saved_past_its_snapshot_fast_forwards_as_torchdata_does(prefetch):
    samples = make_samples([5] * 6)
    every = [signature(b) for b in make(samples, prefetch=prefetch)]
    state = saved_after(1, samples, prefetch=prefetch)
    later = edited(state, lambda s: s["root"].update(steps_since_snapshot=np.int64(1)))
    assert resumed(later, samples, prefetch=prefetch) == every[2:]


def test_a_node_sources_nested_state_must_be_a_dict():
    samples = make_samples([5] * 6)
    state = saved_after(1, samples, "node")
    bad = edited(state, lambda s: source_state(s).update(source=[1]))
    with pytest.raises(ConfigError, match=r"\['source'\]: expected the torchdata node's state"):
        resumed(bad, samples, "node")


def test_a_step_source_alone_takes_a_partial_state_and_refuses_a_non_dict():
    samples = make_samples([5] * 6)
    source = StepSource(samples, batch_size=2)
    source.reset({"step": np.int64(2)})  # missing keys start where a fresh source does
    assert [[i for i, _ in m.items] for m in source] == [[4, 5]]
    with pytest.raises(ConfigError, match=r"state: expected a dict, found \[\]"):
        source.reset([])
    with pytest.raises(ConfigError, match=r"state\['step'\]: expected an int >= 0, found False"):
        source.reset({"step": False})
