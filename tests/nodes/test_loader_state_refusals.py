"""A state refused leaves the loader as it was. ``load_state_dict`` checks the whole state
before any node resets: a refused one raises there and the loader goes on (or starts) exactly
as if it had never been offered. What only the data can refuse (a fast-forward past the end, a
stream shorter than the saved step, a nested source refusing its own state) raises when the
pass starts; the loaded state then stays the loader's state and every pass raises again,
until another state is loaded, never a half-reset pipeline failing untyped."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from source_kinds import SOURCES
from test_loader_state_checks import (
    JUNK,
    edited,
    make,
    make_samples,
    saved_after,
    signature,
    source_state,
)
from torchdata.nodes import BaseNode, IterableWrapper

from r3data.errors import ConfigError

EDITS = {
    "state is a list": (lambda s: [s], r"^state: expected a dict"),
    "num_yielded missing": (lambda s: s.pop("num_yielded"), r"\['num_yielded'\]: expected an int"),
    "num_yielded text": (
        lambda s: s.update(num_yielded="1"),
        r"\['num_yielded'\]: expected an int >= 0, found '1'",
    ),
    "num_yielded negative": (
        lambda s: s.update(num_yielded=-1),
        r"\['num_yielded'\]: expected an int >= 0, found -1",
    ),
    "root None": (lambda s: s.update(root=None), r"state\['root'\]: expected a dict, found None"),
    "root missing": (lambda s: s.pop("root"), r"state\['root'\]: expected a dict, found None"),
    "step negative": (
        lambda s: source_state(s).update(step=-1),
        r"\['step'\]: expected an int >= 0, found -1",
    ),
    "plan changed": (
        lambda s: source_state(s)["plan"].update(batch_size=3),
        r"cannot resume: the state was saved with batch_size=3, found batch_size=2",
    ),
    "foreign nested state": (
        lambda s: source_state(s).update(source={"offset": 3}),
        r"\['source'\]: expected None \(samples of kind 'map' keep no state",
    ),
}


def edit(state, name):
    change, _ = EDITS[name]
    if name == "state is a list":
        return change(copy.deepcopy(state))
    return edited(state, change)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("cut", [0, 1])
@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_refused_load_leaves_the_loader_as_it_was(name, cut, prefetch):
    samples = make_samples([5, 7, 9, 4, 6, 8])
    every = [signature(b) for b in make(samples, prefetch=prefetch)]
    offered = edit(saved_after(1, samples, prefetch=prefetch), name)
    running = make(samples, prefetch=prefetch)
    it = iter(running)
    for _ in range(cut):
        next(it)
    before = running.state_dict() if cut else None
    with pytest.raises(ConfigError, match=EDITS[name][1]):
        running.load_state_dict(offered)
    if cut:  # the pass under way goes on, its state unchanged
        assert running.state_dict() == before
        assert [signature(b) for b in it] == every[cut:]
    else:  # nothing was loaded: the first pass starts at the beginning
        assert [signature(b) for b in running] == every


def fast_forward_past_the_end(samples, prefetch):
    state = saved_after(1, samples, prefetch=prefetch)
    return edited(state, lambda s: s["root"].update(steps_since_snapshot=99))


def stream_shorter_than_the_step(samples, prefetch):
    state = saved_after(2, samples, "re-iterable", prefetch=prefetch)
    return state, SOURCES["re-iterable"](samples[:2])


class Refusing(BaseNode):
    """A torchdata node that refuses any state but its own (as a real one checking its keys)."""

    def __init__(self, samples):
        super().__init__()
        self.inner = IterableWrapper(samples)

    def reset(self, initial_state=None):
        super().reset(initial_state)
        if initial_state is not None and "mine" not in initial_state:
            raise ValueError(f"not my state: {sorted(initial_state)}")
        self.inner.reset(None if initial_state is None else initial_state["mine"])

    def next(self):
        return next(self.inner)

    def get_state(self):
        return {"mine": self.inner.state_dict()}


def refused_when_read(case, samples, prefetch):
    """A state only the data refuses, the samples that refuse it, and the error expected."""
    if case == "fast-forward":
        state = fast_forward_past_the_end(samples, prefetch)
        return state, samples, ConfigError, r"\['steps_since_snapshot'\]: expected at most 2"
    if case == "short stream":
        state, short = stream_shorter_than_the_step(samples, prefetch)
        return state, short, ConfigError, r"cannot resume at step 2: the samples end after 2"
    state = saved_after(1, samples, "node", prefetch=prefetch)
    return state, Refusing(samples), ValueError, r"not my state"


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("case", ["fast-forward", "short stream", "nested refusal"])
def test_a_state_the_data_refuses_stays_loaded_and_every_pass_raises_it(case, prefetch):
    samples = make_samples([5, 7, 9, 4, 6, 8])
    state, source, error, message = refused_when_read(case, samples, prefetch)
    resumed = make(source, prefetch=prefetch)
    resumed.load_state_dict(state)
    for _ in range(2):
        with pytest.raises(error, match=message):
            next(iter(resumed))
        assert resumed.state_dict() == state  # the state refused, never a half-reset one
    good = saved_after(1, samples, prefetch=prefetch)
    rest = [signature(b) for b in make(samples, prefetch=prefetch)][1:]
    again = make(samples, prefetch=prefetch)
    again.load_state_dict(state if case == "fast-forward" else good)
    if case == "fast-forward":  # the same loader takes a good state after the refusal
        with pytest.raises(ConfigError):
            next(iter(again))
        again.load_state_dict(good)
    assert [signature(b) for b in again] == rest
    resumed.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loaded_state_is_the_one_checked_whatever_the_caller_does_with_its_dict(prefetch):
    samples = make_samples([5, 7, 9, 4, 6, 8])
    every = [signature(b) for b in make(samples, prefetch=prefetch)]
    state = saved_after(1, samples, prefetch=prefetch)
    resumed = make(samples, prefetch=prefetch)
    resumed.load_state_dict(state)
    source_state(state)["step"] = -1  # edited after the check: not what the loader resumes
    source_state(resumed.state_dict())["step"] = -1  # nor is the state it returns
    assert [signature(b) for b in resumed] == every[1:]


def test_a_loaded_state_is_the_state_until_a_pass_starts_from_it():
    """torchdata would report the previous pass's state until the next ``iter``: a checkpoint
    taken between a load and the first batch would save the wrong position."""
    samples = make_samples([5, 7, 9, 4, 6, 8])
    later = saved_after(2, samples)
    running = make(samples)
    next(iter(running))
    running.load_state_dict(later)
    assert running.state_dict() == later
    assert [signature(b) for b in running] == [signature(b) for b in make(samples)][2:]


LEAVES = [
    ("num_yielded",),
    ("root", "steps_since_snapshot"),
    ("root", "snapshot", "it_state", "source", "step"),
    ("root", "snapshot", "it_state", "source", "micro_batch"),
    ("root", "snapshot", "it_state", "source", "ended"),
    ("root", "snapshot", "it_state", "source", "plan"),
    ("root", "snapshot", "it_state"),
    ("root", "snapshot"),
    ("root",),
]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 30), min_size=2, max_size=8),
    prefetch=st.sampled_from([0, 2]),
    leaf=st.sampled_from(LEAVES),
    bad=JUNK,
    data=st.data(),
)
def test_any_leaf_edited_to_junk_is_refused_at_load_and_the_pass_goes_on(
    lengths, prefetch, leaf, bad, data
):
    """Whichever key of a real state is edited to a value no state holds, the load raises a
    ``ConfigError`` naming that key, and the pass under way yields exactly what it would."""
    if leaf[-1] == "ended" and isinstance(bad, bool):
        bad = None  # either bool is a state's
    samples = make_samples(lengths)
    every = [signature(b) for b in make(samples, prefetch=prefetch)]
    state = saved_after(data.draw(st.integers(0, len(every)), label="saved at"), samples)
    cut = data.draw(st.integers(0, len(every)), label="running at")
    running = make(samples, prefetch=prefetch)
    it = iter(running)
    for _ in range(cut):
        next(it)

    def change(s):
        *path, key = leaf
        for name in path:
            s = s[name]
        s[key] = bad

    offered = edited(state, change)
    with pytest.raises(ConfigError, match=rf"\['{leaf[-1]}'\]: expected "):
        running.load_state_dict(offered)
    assert [signature(b) for b in it] == every[cut:]
