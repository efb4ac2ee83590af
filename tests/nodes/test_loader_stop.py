"""A loader that stops early (reset, dropped, the interpreter exiting) while the next batch's
reads are stalled on the store: those reads stop at their next call, the shared pool's lanes
are free again within about one call's timeout, a reset loader yields the right batches, and
the interpreter's exit is not held by reads retrying on."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # stalling

import numpy as np
import pytest
from stalling import SlowMemory

from r3data import loader
from r3data.errors import PayloadReadError
from r3data.nodes import CollateRollouts, StitchRollout
from r3data.parallel import fill_rows, io_workers
from r3data.payload import PayloadReader, PayloadWriter
from r3data.payload.fs import PayloadRoot
from r3data.payload.reader import PlanStop

LAYERS, TOPK = 2, 2
TIMEOUT = 0.3
"""Each call's deadline: with the reader's 4 retries and backoff, about 3 s of retrying per
stalled file if nothing stops it."""
QUIET_S = 3 * TIMEOUT + 0.6
"""Long enough for at least two more attempts (call, backoff) of a read that was not stopped."""


class StalledFiles(SlowMemory):
    """A private memory:// store whose look-ups (``hold="info"``) or reads (``"read"``) of the
    files in ``stalled`` wait for ``release``; ``touched`` records each such call."""

    def __init__(self, hold: str) -> None:
        super().__init__()
        self.stall = hold
        self.stalled: set[str] = set()
        self.touched: list[str] = []

    def _held(self, path: str, kind: str) -> None:
        path = self._strip_protocol(path)
        if kind == self.stall and path in self.stalled:
            self.touched.append(path)
            self.reading.set()
            self.release.wait()

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._held(path, "info")
        return super().info(path, **kwargs)

    def before_read(self, path: str, offset: int) -> None:
        self._held(path, "read")


def by_handle_samples(fs: StalledFiles, count: int) -> tuple[list[dict], list[np.ndarray]]:
    """Two-turn samples, each turn's routes in a file of its own; and each sample's routes
    (the last token a copy of the row before it)."""
    writer = PayloadWriter("/run", fs=fs)
    rng = np.random.default_rng(0)
    samples, expected = [], []
    for i in range(count):
        first = rng.integers(0, 8, (4, LAYERS, TOPK)).astype(np.uint8)
        second = rng.integers(0, 8, (5, LAYERS, TOPK)).astype(np.uint8)
        requests = [
            {
                "prompt_len": 2,
                "completion_len": 3,
                "sources": [writer.write(0, {"routed_experts": first})[0].to_dict()],
            },
            {
                "prompt_len": 7,
                "completion_len": 3,
                "sources": [writer.write(0, {"routed_experts": second}, pos=4)[0].to_dict()],
            },
        ]
        samples.append({"id": f"s{i}", "token_ids": np.arange(10), "requests": requests})
        rows = np.concatenate([first, second])
        expected.append(np.concatenate([rows, rows[-1:]]))
    return samples, expected


def files_of(sample: dict) -> set[str]:
    return {f"/run/{r['sources'][0]['file']}" for r in sample["requests"]}


@pytest.fixture(name="store", params=["info", "read"], ids=["stalled_opens", "stalled_reads"])
def store_fixture(request) -> Any:
    fs = StalledFiles(request.param)
    yield fs
    fs.release.set()


def stalled_loader(store: StalledFiles, prefetch: int = 1):
    """A loader over three samples whose second one's files stall, its first batch taken and
    the second's fill blocked on the store."""
    samples, expected = by_handle_samples(store, 3)
    store.stalled = files_of(samples[1])
    root = PayloadRoot("/run", fs=store, timeout=TIMEOUT)
    ld = loader(samples, batch_size=1, payload_root=root, prefetch=prefetch, collate={"workers": 2})
    it = iter(ld)
    first = next(it)
    assert first["sample_id"] == ["s0"]
    assert store.reading.wait(5), "the second batch's fill never reached the store"
    blocked = 2 if store.stall == "info" else 1  # both files' looks at once; reads one by one
    deadline = time.monotonic() + 5
    while len(store.touched) < blocked and time.monotonic() < deadline:
        time.sleep(0.01)
    return ld, it, expected


def assert_stopped(store: StalledFiles, calls: int) -> None:
    """The stalled reads make no further call, and every lane of the shared pool is free."""
    lanes = io_workers()
    together = threading.Barrier(lanes, timeout=TIMEOUT + 1.0)
    start = time.monotonic()
    fill_rows(lambda i: together.wait(), lanes, lanes)  # needs every lane at once
    assert time.monotonic() - start < TIMEOUT + 1.0
    time.sleep(QUIET_S)
    assert store.touched[calls:] == []


def test_a_reset_stops_the_stalled_reads_and_the_loader_yields_the_right_batches(store):
    ld, _, expected = stalled_loader(store)
    calls = len(store.touched)
    start = time.monotonic()
    again = iter(ld)  # a reset: the first run's thread is shut down
    assert time.monotonic() - start < TIMEOUT + 1.5
    assert_stopped(store, calls)
    store.stalled.clear()
    store.release.set()
    batches = list(again)
    assert [b["sample_id"] for b in batches] == [["s0"], ["s1"], ["s2"]]
    for batch, routes in zip(batches, expected, strict=True):
        assert np.array_equal(batch["routed_experts"][0].numpy(), routes)


def test_a_dropped_loader_stops_its_stalled_reads(store):
    ld, it, _ = stalled_loader(store)
    dropped = weakref.ref(ld)
    del ld, it
    # a collection frees it (its nodes reference each other); something transient on another
    # thread (a frame of torchdata's) may hold it through one collection, not through several
    deadline = time.monotonic() + 5
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert dropped() is None, [type(r).__name__ for r in gc.get_referrers(dropped())]
    time.sleep(QUIET_S)  # a call under way when it was collected reaches its next check
    assert_stopped(store, len(store.touched))


def test_an_in_place_loader_reset_after_a_run_yields_every_batch():
    """With ``prefetch=0`` a reset stops the run before it: the next run is not stopped."""
    store = StalledFiles("")
    samples, expected = by_handle_samples(store, 3)
    ld = loader(samples, batch_size=1, payload_root=PayloadRoot("/run", fs=store), prefetch=0)
    assert next(iter(ld))["sample_id"] == ["s0"]
    for _ in range(2):
        batches = list(ld)
        assert [b["sample_id"] for b in batches] == [["s0"], ["s1"], ["s2"]]
        assert np.array_equal(batches[2]["routed_experts"][0].numpy(), expected[2])


EXITING = """
import sys, threading, time
sys.path.insert(0, {tests!r})
sys.path.insert(0, {payload_tests!r})
from test_loader_stop import StalledFiles, by_handle_samples, files_of
from r3data import loader
from r3data.payload.fs import PayloadRoot

store = StalledFiles("info")
samples, _ = by_handle_samples(store, 3)
store.stalled = files_of(samples[1])
root = PayloadRoot("/run", fs=store, timeout={timeout})
ld = loader(samples, batch_size=1, payload_root=root, prefetch={prefetch})


def run():
    for batch in ld:
        pass


if {prefetch}:
    for batch in ld:
        break  # the next batch is being prepared in the background
else:  # the trainer's own background thread runs the loader in place
    threading.Thread(target=run, daemon=True).start()
store.reading.wait(10)
time.sleep(0.1)
print(time.time(), flush=True)
"""


def run_script(template: str, limit_s: float, **fields: Any) -> subprocess.CompletedProcess:
    """``template`` (importing this module's helpers) run by a fresh interpreter."""
    script = template.format(
        tests=str(Path(__file__).resolve().parent),
        payload_tests=str(Path(__file__).resolve().parents[1] / "payload"),
        **fields,
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=limit_s,
        env=env,
    )


@pytest.mark.parametrize("prefetch", [2, 0], ids=["prefetching", "in_place_on_a_thread"])
def test_interpreter_exit_is_not_held_by_stalled_reads(prefetch):
    timeout = 1.0  # unstopped: 5 attempts of 1 s plus 1.5 s of backoff per file
    done = run_script(EXITING, 60, timeout=timeout, prefetch=prefetch)
    ended = time.time()
    assert done.returncode == 0, done.stderr
    exiting = float(done.stdout.split()[-1])
    assert ended - exiting < timeout + 2.0, done.stderr  # not the 6.5 s of retries


def test_nodes_built_by_hand_take_an_optional_stop():
    store = StalledFiles("")
    samples, expected = by_handle_samples(store, 2)
    reader = PayloadReader("/run", fs=store, timeout=TIMEOUT)
    stitch = StitchRollout(["routed_experts"])
    collate = CollateRollouts(["routed_experts"], reader, workers=2)
    rollouts = [stitch((i, s)) for i, s in enumerate(samples)]
    stop = PlanStop()
    stop.set()
    store.calls.clear()
    with pytest.raises(PayloadReadError, match="stopped"):
        collate(rollouts, stop=stop)
    assert store.calls == []  # stopped before its first call to the store
    batch = collate(rollouts, stop=PlanStop())
    assert np.array_equal(batch["routed_experts"][1].numpy(), expected[1])
    assert np.array_equal(collate(rollouts)["routed_experts"][0].numpy(), expected[0])


COLLECTED_WHILE_CLOSING = """
import gc, sys, time
sys.path.insert(0, {tests!r})
sys.path.insert(0, {payload_tests!r})
from test_loader_stop import StalledFiles, by_handle_samples
from r3data import loader
from r3data.payload.fs import PayloadRoot

store = StalledFiles("")
samples, _ = by_handle_samples(store, 3)
gc.collect()
gc.disable()  # the loader's objects stay young: the next collection can take them
ld = loader(samples, batch_size=1, payload_root=PayloadRoot("/run", fs=store), prefetch=1)
it = iter(ld)
next(it)
time.sleep(0.5)  # its thread has prepared the next batch and waits
stops = ld.root.pipeline.source.stops
lock = stops._lock
holder = [ld, it]
del ld, it


def held() -> bool:  # by this thread
    return lock._is_owned() if hasattr(lock, "_is_owned") else lock.locked()


def dropped(phase, info):  # the trainer's last reference goes just as a collection starts
    if phase == "start" and held():
        holder.clear()


gc.callbacks.append(dropped)
gc.set_threshold(1, 1, 1)  # every allocation collects, wherever it happens
gc.enable()
stops.close()  # what the interpreter's exit runs
print("closed", flush=True)
"""


def test_a_loader_collected_while_its_stops_are_being_set_does_not_deadlock():
    """A collection can run on any thread at any allocation: here on the thread closing the
    loader's stops (the interpreter's exit, a reset), inside their lock, and it collects the
    dropped loader, whose finalizer closes the same stops."""
    try:
        done = run_script(COLLECTED_WHILE_CLOSING, 30)
    except subprocess.TimeoutExpired:
        pytest.fail("closing the stops deadlocked on their own lock")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed"]


def exits() -> None:
    pass


def test_a_child_forked_while_a_batch_is_being_prepared_exits():
    """A child forked while a thread of the parent held a loader's stops' lock (its prefetch
    thread taking its stop for the next batch) has no such thread: its exit (which closes
    every loader's stops) must not wait for that lock forever."""
    store = StalledFiles("")
    samples, _ = by_handle_samples(store, 3)
    ld = loader(samples, batch_size=1, payload_root=PayloadRoot("/run", fs=store), prefetch=1)
    it = iter(ld)
    next(it)
    stops = ld.root.pipeline.source.stops
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # where the prefetch thread is for a moment in each batch
        with stops._lock:
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)
    child = multiprocessing.get_context("fork").Process(target=exits)
    try:
        child.start()
        release.set()
        holder.join()
        child.join(10)
        assert child.exitcode == 0, "the forked child hung at its exit"
    finally:
        release.set()
        if child.exitcode is None:
            child.kill()
            child.join()
