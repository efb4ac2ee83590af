"""The per-call timeout on a filesystem that is neither local-backed nor run on an event loop:
a call past its deadline is a typed error in bounded time, and a read abandoned at its
deadline never writes into the caller's buffer afterwards. (The event-loop case, s3fs
behind a stalling proxy, is in ``tests/integration/test_s3_slow_store.py``.)"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from stalling import SlowMemory, hung_calls, wait_for

from r3data.errors import ConfigError, PayloadReadError, PayloadWriteError
from r3data.payload import PayloadReader, PayloadRetention, PayloadRoot, PayloadWriter, deadline

TIMEOUT = 0.3


@pytest.fixture(name="slow")
def slow_fixture() -> Any:
    fs = SlowMemory()
    yield fs
    fs.release.set()


def written(fs: SlowMemory, rows: int = 20) -> tuple[Any, np.ndarray]:
    data = np.arange(rows * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(rows, 48, 8)
    (segment,) = PayloadWriter("/run", fs=fs).write(1, {"routes": data})
    return segment, data


def test_a_read_past_its_deadline_never_writes_into_the_batch_later(slow):
    segment, data = written(slow)
    reader = PayloadReader("/run", fs=slow, timeout=TIMEOUT, retries=1, backoff=0.01)
    out = np.zeros_like(data)
    slow.hold = "read"
    start = time.monotonic()
    with pytest.raises(PayloadReadError, match=rf"memory:///run/{segment.file} .*failed 2 times"):
        reader.read_into([segment], out)
    assert 2 * TIMEOUT <= time.monotonic() - start < 2 * TIMEOUT + 1.0
    slow.release.set()  # the abandoned reads go on and land ...
    assert slow.landed.wait(5)
    time.sleep(0.05)
    assert not out.any()  # ... in buffers of their own, not the batch's
    slow.hold = ""
    reader.read_into([segment], out)
    np.testing.assert_array_equal(out, data)


def test_an_open_and_a_size_check_past_their_deadline_name_the_file(slow):
    segment, _ = written(slow)
    reader = PayloadReader("/run", fs=slow, timeout=TIMEOUT, retries=0)
    slow.hold = "info"
    with pytest.raises(PayloadReadError, match=r"no answer within the timeout of 0\.3 s") as caught:
        reader.check_sizes([segment])
    assert f"memory:///run/{segment.file}" in str(caught.value)
    with pytest.raises(PayloadReadError, match=rf"{segment.file} .*failed 1 times"):
        reader.read([segment])


def test_without_a_timeout_a_read_waits_for_the_filesystem(slow):
    segment, data = written(slow)
    reader = PayloadReader("/run", fs=slow, timeout=None)
    slow.hold = "read"
    threading.Timer(2 * TIMEOUT, slow.release.set).start()
    np.testing.assert_array_equal(reader.read([segment])["routes"], data)


def test_a_deletion_past_its_deadline_is_logged_and_retried(slow, caplog):
    segment, _ = written(slow)
    retention = PayloadRetention("/run", 5, fs=slow, fresh=False, timeout=TIMEOUT)
    retention.claim(1, [segment.file])
    slow.hold = "rm"
    retention.on_policy_update(1)
    retention.wait()
    assert retention.metrics().delete_errors == 1
    assert "retried later" in caplog.text
    slow.hold = ""
    slow.release.set()
    retention.on_policy_update(1)
    retention.wait()
    assert retention.metrics().files_pending == 0
    assert not slow.exists(f"/run/{segment.file}")


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 1e300, "30", True])
def test_a_timeout_must_be_positive_finite_seconds_or_none(bad):
    with pytest.raises(ConfigError, match="timeout must be"):
        PayloadReader("memory://r3-timeouts", timeout=bad)
    with pytest.raises(ConfigError, match="timeout must be"):
        PayloadRoot("memory://r3-timeouts", timeout=bad)


def deadline_threads() -> int:
    return sum(t.name == "r3data-deadline" for t in threading.enumerate())


def test_a_store_that_stays_stalled_leaves_a_bounded_number_of_calls_behind(slow, monkeypatch):
    segment, _ = written(slow)
    monkeypatch.setattr(deadline, "MAX_HUNG_CALLS", 3)
    reader = PayloadReader("/run", fs=slow, timeout=0.05, retries=0)
    slow.hold = "info"
    before = deadline_threads()
    for _ in range(8):  # every batch tries again; each call it abandons stays blocked
        with pytest.raises(PayloadReadError, match=r"memory:///run/"):
            reader.check_sizes([segment])
    assert deadline_threads() - before <= 3
    assert hung_calls() == 3
    start = time.monotonic()
    with pytest.raises(PayloadReadError, match=r"3 earlier calls .* still unanswered"):
        reader.check_sizes([segment])
    assert time.monotonic() - start < 0.05  # refused at once, no thread started
    slow.release.set()  # the store answers again: the abandoned calls end ...
    assert wait_for(lambda: hung_calls() == 0)
    slow.hold = ""
    assert reader.read([segment])  # ... and calls go through again


def test_a_file_opened_after_its_deadline_is_closed(slow):
    segment, _ = written(slow)
    reader = PayloadReader("/run", fs=slow, timeout=TIMEOUT, retries=0)
    slow.hold = "open"
    with pytest.raises(PayloadReadError, match=r"opening memory:///run/.*no answer"):
        reader.read([segment])
    slow.release.set()
    deadline = time.monotonic() + 5
    while not slow.late and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert slow.late
    assert all(f.closed for f in slow.late)


def test_a_stalled_store_fails_a_retention_pass_in_one_timeout_not_one_per_file(slow, caplog):
    files = [written(slow, rows=2)[0].file for _ in range(12)]
    retention = PayloadRetention("/run", 5, fs=slow, fresh=False, timeout=0.2)
    retention.claim(1, files)
    slow.hold = "rm"
    start = time.monotonic()
    retention.on_policy_update(1)
    retention.close()  # bounded by one call's timeout, not 12 of them
    assert time.monotonic() - start < 0.2 * 3
    metrics = retention.metrics()
    assert metrics.files_pending == len(files)
    assert metrics.delete_errors == 1
    slow.hold = ""
    slow.release.set()
    retention.on_policy_update(1)
    retention.close()
    assert retention.metrics().files_pending == 0
    assert not any(slow.exists(f"/run/{f}") for f in files)


def test_gc_on_a_stalled_store_stops_at_its_first_timeout(slow):
    from r3data.payload.retention import gc

    files = [written(slow, rows=2)[0].file for _ in range(12)]
    slow.hold = "rm"
    start = time.monotonic()
    report = gc("/run", 10, 1, fs=slow, timeout=0.2)
    assert time.monotonic() - start < 0.2 * 3  # one call's timeout, not one per file
    assert report.files == []
    assert len(report.errors) == 1
    assert "no answer within the timeout of 0.2 s" in report.errors[0]
    assert "1 of 12 files tried" in report.errors[0]
    slow.hold = ""
    slow.release.set()
    removed = gc("/run", 10, 1, fs=slow, timeout=0.2).files  # the abandoned one may land first
    assert len(removed) >= len(files) - 1
    assert set(removed) <= set(files)
    assert not any(slow.exists(f"/run/{f}") for f in files)


def test_a_fresh_run_on_a_stalled_store_fails_at_its_first_timeout(slow):
    for _ in range(12):
        written(slow, rows=2)
    slow.hold = "rm"
    start = time.monotonic()
    with pytest.raises(
        PayloadWriteError, match=r"fresh run: .*memory:///run.* no answer"
    ) as caught:
        PayloadRetention("/run", 5, fs=slow, fresh=True, run_started=time.time() + 60, timeout=0.2)
    assert time.monotonic() - start < 0.2 * 3  # one call's timeout, not one per file
    assert "stopped after 1 of 12 files" in str(caught.value)


class Recording(SlowMemory):
    """A :class:`SlowMemory` that records which thread each look-up ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []  # held: an ident is reused once one ends

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.threads.append(threading.current_thread())
        return super().info(path, **kwargs)


@pytest.fixture(name="recording")
def recording_fixture() -> Any:
    fs = Recording()
    yield fs
    fs.release.set()


def test_calls_with_a_deadline_reuse_idle_threads(recording):
    written(recording)
    root = PayloadRoot("/run", fs=recording, timeout=TIMEOUT)
    before = deadline_threads()
    idle = {t for t in threading.enumerate() if t.name == "r3data-deadline"}
    for _ in range(50):
        assert root.call("exists", "/run")
    assert len(recording.threads) >= 50
    assert len(set(recording.threads) - idle) <= 3  # not one thread per call
    assert threading.current_thread() not in recording.threads  # still off the caller's
    assert deadline_threads() - before <= 3


def test_a_hung_call_keeps_its_thread_and_holds_up_no_other(recording):
    written(recording)
    root = PayloadRoot("/run", fs=recording, timeout=TIMEOUT)
    recording.hold = "info"
    with pytest.raises(PayloadReadError, match=r"info of memory:///run: no answer"):
        root.call("info", "/run")
    hung = recording.threads[-1]
    recording.hold = ""
    for _ in range(5):
        start = time.monotonic()
        assert root.call("info", "/run")["type"] == "directory"
        assert time.monotonic() - start < TIMEOUT / 2
    assert hung not in recording.threads[1:]
    assert hung_calls() == 1
    recording.release.set()
    assert wait_for(lambda: hung_calls() == 0)


def test_a_forked_child_starts_its_own_threads_and_counts_none_of_the_parents(
    recording, monkeypatch
):
    written(recording)
    monkeypatch.setattr(deadline, "MAX_HUNG_CALLS", 1)
    root = PayloadRoot("/run", fs=recording, timeout=TIMEOUT)
    assert root.call("exists", "/run")  # an idle thread, which the child does not inherit
    recording.hold = "info"
    with pytest.raises(PayloadReadError, match="no answer"):
        root.call("info", "/run")
    recording.hold = ""
    with pytest.raises(PayloadReadError, match=r"1 earlier calls .* still unanswered"):
        root.call("info", "/run")
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        try:
            code = 0 if root.call("info", "/run")["type"] == "directory" else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    recording.release.set()
    assert wait_for(lambda: hung_calls() == 0)
