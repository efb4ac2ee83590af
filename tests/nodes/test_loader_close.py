"""A loader closed by the trainer (``close()`` or a ``with`` block): its stalled reads stop
and the shared pool's lanes are free within about one call's timeout, the prefetch thread ends,
iterating again is a typed error, and the state saved before the close resumes a new loader at
the right batch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_loader_stop import (
    TIMEOUT,
    StalledFiles,
    assert_stopped,
    by_handle_samples,
    files_of,
    stalled_loader,
    store_fixture,  # noqa: F401  (the stalled store, as a fixture named "store")
)

from r3data import BatchLoader, loader
from r3data.errors import PayloadReadError, UsageError
from r3data.payload.fs import PayloadRoot

PREFETCH = pytest.mark.parametrize("prefetch", [2, 0], ids=["prefetching", "in_place"])


def prefetch_threads() -> set[threading.Thread]:
    """torchdata's prefetch threads alive now (its worker function names them)."""
    return {t for t in threading.enumerate() if t.is_alive() and "_populate_queue" in t.name}


def ids(batches) -> list[list[str]]:
    return [b["sample_id"] for b in batches]


def test_closing_stops_the_stalled_reads_and_the_prefetch_thread(store):
    before = prefetch_threads()
    ld, it, _ = stalled_loader(store, prefetch=2)
    assert isinstance(ld, BatchLoader)
    assert prefetch_threads() - before, "no prefetch thread to stop"
    calls = len(store.touched)
    start = time.monotonic()
    ld.close()
    assert time.monotonic() - start < TIMEOUT + 1.5
    assert ld.closed
    assert_stopped(store, calls)
    assert prefetch_threads() - before == set()
    with pytest.raises(UsageError, match="closed"):
        next(it)
    with pytest.raises(UsageError, match="closed"):
        iter(ld)
    ld.close()  # again: nothing to do
    assert ld.closed


def test_an_in_place_loader_closed_while_another_thread_runs_it_stops_that_batch(store):
    samples, _ = by_handle_samples(store, 3)
    store.stalled = files_of(samples[0])
    root = PayloadRoot("/run", fs=store, timeout=TIMEOUT)
    ld = loader(samples, batch_size=1, payload_root=root, prefetch=0, collate={"workers": 2})
    failures: list[BaseException] = []

    def run() -> None:
        try:
            for _ in ld:
                pass
        except BaseException as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    assert store.reading.wait(5), "the first batch's fill never reached the store"
    ld.close()
    runner.join(TIMEOUT + 2.0)
    assert not runner.is_alive(), "the batch in flight did not stop"
    assert_stopped(store, len(store.touched))
    assert len(failures) == 1, failures
    assert isinstance(failures[0], PayloadReadError), repr(failures[0])
    assert "shut down" in str(failures[0]) or "stopped" in str(failures[0]), failures[0]


@PREFETCH
def test_the_state_saved_before_a_close_resumes_a_new_loader_at_the_next_batch(prefetch):
    store = StalledFiles("")
    samples, expected = by_handle_samples(store, 4)
    root = PayloadRoot("/run", fs=store)

    def make() -> BatchLoader:
        return loader(samples, batch_size=1, payload_root=root, prefetch=prefetch)

    with make() as ld:
        it = iter(ld)
        assert ids([next(it), next(it)]) == [["s0"], ["s1"]]
    assert ld.closed
    state = ld.state_dict()  # after the close, as before it
    assert state == ld.state_dict()
    again = make()
    again.load_state_dict(state)
    rest = list(again)
    assert ids(rest) == [["s2"], ["s3"]]
    assert np.array_equal(rest[1]["routed_experts"][0].numpy(), expected[3])


@PREFETCH
def test_a_loader_closed_before_its_first_pass_has_no_state_and_does_not_start(prefetch):
    store = StalledFiles("")
    samples, _ = by_handle_samples(store, 2)
    before = prefetch_threads()
    ld = loader(
        samples, batch_size=1, payload_root=PayloadRoot("/run", fs=store), prefetch=prefetch
    )
    ld.close()
    with pytest.raises(UsageError, match="closed before its first"):
        ld.state_dict()
    with pytest.raises(UsageError, match="closed"):
        iter(ld)
    assert prefetch_threads() - before == set()
    root = PayloadRoot("/run", fs=store)
    state = loader(samples, batch_size=1, payload_root=root, prefetch=0).state_dict()
    loaded = loader(samples, batch_size=1, payload_root=root)
    loaded.load_state_dict(state)
    loaded.close()
    assert loaded.state_dict() == state  # loaded, never started: returned as loaded
