"""A batch that failed (a payload file missing for a moment, a body that could not be read) is
prepared again by a loader resumed from the state saved after the failure: nothing skipped,
nothing repeated, whatever the prefetch depth, the micro-batching and the kind of source."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from source_kinds import SOURCES

from r3data import loader
from r3data.errors import PayloadReadError, WireFormatError
from r3data.nodes import MicroBatches
from r3data.payload import PayloadWriter
from r3data.wire import InlineRows

LAYERS, TOPK, EXPERTS, SAMPLES = 2, 2, 16, 12


def by_handle_samples(root, rng):
    """Samples whose routes each sit in a payload file of their own, named by their index."""
    writer = PayloadWriter(root)
    samples, files = [], []
    for i in range(SAMPLES):
        rows = rng.integers(0, EXPERTS, (4, LAYERS, TOPK)).astype(np.uint8)
        (segment,) = writer.write(0, {"routed_experts": rows})
        request = {"prompt_len": 1, "completion_len": 4, "sources": [segment.to_dict()]}
        samples.append({"id": f"s{i}", "token_ids": np.arange(5), "requests": [request]})
        files.append(root / segment.file)
    return samples, files


def inline_samples(rng):
    samples = []
    for i in range(SAMPLES):
        rows = rng.integers(0, EXPERTS, (4, LAYERS, TOPK)).astype(np.uint8)
        request = {"prompt_len": 1, "completion_len": 4}
        request["sources"] = [InlineRows("routed_experts", rows, 0)]
        samples.append({"id": f"s{i}", "token_ids": np.arange(5), "requests": [request]})
    return samples


def signature(batch) -> tuple:
    return (batch.metadata["step"], batch.metadata["micro_batch"], tuple(batch["sample_id"]))


def make(samples, prefetch, micro, **options):
    return loader(
        samples,
        batch_size=4,
        micro_batches=micro,
        prefetch=prefetch,
        collate={"workers": 1},
        **options,
    )


def with_broken_body(samples, index):
    """The samples with one's routes replaced by a vLLM body that cannot be read."""
    broken = {"producer": "vllm", "response": b"{"}
    request = {**samples[index]["requests"][0], "sources": [broken]}
    return [*samples[:index], {**samples[index], "requests": [request]}, *samples[index + 1 :]]


def delivered_until_failure(batches) -> tuple[list[tuple], BaseException]:
    got, iterator = [], iter(batches)
    while True:
        try:
            got.append(signature(next(iterator)))
        except (PayloadReadError, WireFormatError) as error:
            return got, error
        except StopIteration:
            pytest.fail(f"expected a failure, found {len(got)} batches delivered")


@pytest.mark.parametrize(
    ("prefetch", "micro"), list(itertools.product([0, 1, 2], [None, MicroBatches(size=2)]))
)
def test_a_file_missing_for_a_moment_is_read_by_the_resumed_loader(tmp_path, prefetch, micro):
    samples, files = by_handle_samples(tmp_path, np.random.default_rng(prefetch))
    every = [signature(b) for b in make(samples, prefetch, micro, payload_root=str(tmp_path))]
    hidden = files[6].with_suffix(".away")
    files[6].rename(hidden)  # sample 6: step 1
    batches = make(samples, prefetch, micro, payload_root=str(tmp_path))
    got, error = delivered_until_failure(batches)
    assert "s6" in str(error) or files[6].name in str(error)
    state = batches.state_dict()
    batches.close()
    hidden.rename(files[6])  # the store is back
    resumed = make(samples, prefetch, micro, payload_root=str(tmp_path))
    resumed.load_state_dict(state)
    rest = [signature(b) for b in resumed]
    assert got + rest == every  # the failed batch comes again, once, in its place
    assert any("s6" in ids for *_, ids in rest[:1])


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_kind_of_source_resumes_at_the_batch_that_failed(kind):
    good = inline_samples(np.random.default_rng(1))
    bad = with_broken_body(good, 9)
    every = [signature(b) for b in make(SOURCES[kind](good), 1, MicroBatches(size=2))]
    batches = make(SOURCES[kind](bad), 1, MicroBatches(size=2))
    got, _ = delivered_until_failure(batches)
    state = batches.state_dict()
    resumed = make(SOURCES[kind](good), 1, MicroBatches(size=2))
    resumed.load_state_dict(state)
    assert got + [signature(b) for b in resumed] == every


def test_a_loader_iterated_on_past_a_failure_saves_a_state_after_the_next_batch():
    good = inline_samples(np.random.default_rng(2))
    bad = with_broken_body(good, 0)
    every = [signature(b) for b in make(good, 0, MicroBatches(size=2))]
    batches = make(bad, 0, MicroBatches(size=2))
    iterator = iter(batches)
    with pytest.raises(WireFormatError):
        next(iterator)
    assert signature(next(iterator)) == every[1]  # the trainer chose to go on without it
    state = batches.state_dict()
    resumed = make(good, 0, MicroBatches(size=2))
    resumed.load_state_dict(state)
    assert [signature(b) for b in resumed] == every[2:]


@settings(max_examples=12, deadline=None)
@given(
    broken=st.integers(0, SAMPLES - 1),
    prefetch=st.integers(0, 2),
    size=st.sampled_from([1, 2, 4]),
)
def test_a_resume_after_any_failure_delivers_every_batch_exactly_once(broken, prefetch, size):
    good = inline_samples(np.random.default_rng(3))
    bad = with_broken_body(good, broken)
    every = [signature(b) for b in make(good, prefetch, MicroBatches(size=size))]
    batches = make(bad, prefetch, MicroBatches(size=size))
    got, _ = delivered_until_failure(batches)
    state = batches.state_dict()
    batches.close()
    resumed = make(good, prefetch, MicroBatches(size=size))
    resumed.load_state_dict(state)
    assert got + [signature(b) for b in resumed] == every
