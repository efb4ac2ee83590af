"""The writer's per-call timeout on a filesystem that is neither local-backed nor run on an
event loop: a call past its deadline (the folder's makedirs, a block's upload, the publish at
close, the single put of memory://) is a typed error naming the file and the timeout, and
nothing is published under the final name, not even when the abandoned call completes after
its caller was told the write failed. (s3fs behind a stalling proxy, where each request is
cancelled at its deadline, is in ``tests/integration/test_s3_slow_store.py``.)"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from fsspec.spec import AbstractBufferedFile
from stalling import SlowMemory, hung_calls, wait_for
from store_helpers import MemoryBacked

from r3data.errors import ConfigError, PayloadWriteError
from r3data.payload import PayloadReader, PayloadRoot, PayloadWriter, abort_retry, deadline
from r3data.payload import upload as upload_module
from r3data.payload import writer as writer_module

TIMEOUT = 0.3
ROOT = "/run"
BLOCK = 64 << 10
ROUTES = np.arange(1000 * 48 * 8, dtype=np.uint32).astype(np.uint8).reshape(1000, 48, 8)  # 6 blocks


class HeldUpload(AbstractBufferedFile):
    """An upload the way s3fs makes one: a part per full block, the object published (and only
    then visible) when the last part is sent at close; each may wait for its store's
    ``release``."""

    def _initiate_upload(self) -> None:
        self.parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        store = self.fs
        store.wait_if("publish" if final else "upload")
        self.parts.append(self.buffer.getvalue())
        if final:
            store.objects.pipe_file(self.path, b"".join(self.parts))
            store.published.append(self.path)
        return True

    def discard(self) -> None:
        self.fs.discarded.append(self.path)


class HeldStore(MemoryBacked):
    """An object store held in memory whose makedirs (``hold="makedirs"``), block uploads
    (``"upload"``) or publish at close (``"publish"``) wait for ``release``."""

    protocol = "held"

    def __init__(self) -> None:
        super().__init__()
        self.hold = ""
        self.release, self.waiting = threading.Event(), threading.Event()
        self.published: list[str] = []
        self.discarded: list[str] = []

    def wait_if(self, step: str) -> None:
        if self.hold == step:
            self.waiting.set()
            self.release.wait()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.wait_if("makedirs")

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode == "rb":
            return self.objects.open(path, "rb")
        return HeldUpload(self, path, mode, block_size=BLOCK)


class HeldPut(SlowMemory):
    """A private memory:// store whose puts wait for ``release`` with ``hold="put"``."""

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        if self.hold == "put":
            self.release.wait()
        super().pipe_file(path, value, **kwargs)


@pytest.fixture(name="store")
def store_fixture() -> Any:
    fs = HeldStore()
    yield fs
    fs.release.set()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 1e300, "30", True])
def test_a_writer_timeout_must_be_positive_finite_seconds_or_none(bad):
    with pytest.raises(ConfigError, match="timeout must be"):
        PayloadWriter("memory://r3-writer-timeouts", timeout=bad)


def test_the_writer_timeout_defaults_to_the_readers_and_none_is_no_limit():
    assert PayloadWriter("memory://r3-writer-timeouts").timeout == deadline.DEFAULT_TIMEOUT_S
    assert PayloadWriter("memory://r3-writer-timeouts", timeout=None).timeout is None
    assert PayloadWriter("memory://r3-writer-timeouts", timeout=2).timeout == 2.0


@pytest.mark.parametrize("hold", ["makedirs", "upload", "publish"])
def test_a_stalled_call_fails_the_write_typed_and_publishes_nothing_even_later(store, hold):
    store.hold = hold
    writer = PayloadWriter(ROOT, fs=store, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(PayloadWriteError) as caught:
        writer.write(1, {"routes": ROUTES})
    took = time.monotonic() - start
    message = str(caught.value)
    assert message.startswith("writing payload file held:///run/v1/"), message
    assert f"no answer within the timeout of {TIMEOUT:g} s" in message, message
    assert TIMEOUT <= took < 3 * TIMEOUT + 1.0, took  # the call, then the abort and the look
    assert store.objects.find(ROOT) == []
    if hold != "makedirs":
        assert len(store.discarded) == 1  # the upload was discarded
    store.release.set()  # the abandoned call completes after all ...
    assert wait_for(lambda: hung_calls() == 0)
    time.sleep(0.05)
    if hold == "publish":
        assert len(store.published) == 1  # ... it did publish, late ...
    assert store.objects.find(ROOT) == []  # ... and what it published was deleted


def test_a_stalled_single_put_fails_typed_and_what_lands_later_is_deleted():
    fs = HeldPut()
    fs.hold = "put"
    try:
        with pytest.raises(
            PayloadWriteError, match=r"memory:///run/v1/\w+\.bin: putting .*timeout of 0\.3 s"
        ):
            PayloadWriter(ROOT, fs=fs, timeout=TIMEOUT).write(1, {"routes": ROUTES})
        assert fs.find(ROOT) == []
    finally:
        fs.release.set()
    assert wait_for(lambda: hung_calls() == 0)
    time.sleep(0.05)
    assert fs.find(ROOT) == []


class FlakyRemove(HeldPut):
    """A held-put store whose first ``failures`` deletions fail (a store still recovering)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def rm_file(self, path: str) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("the store refused the deletion")
        super().rm_file(path)


def test_a_late_publish_whose_deletion_fails_is_deleted_in_the_background():
    fs = FlakyRemove(failures=2)
    fs.hold = "put"
    try:
        with pytest.raises(PayloadWriteError, match=r"putting .*timeout of 0\.3 s"):
            PayloadWriter(ROOT, fs=fs, timeout=TIMEOUT).write(1, {"routes": ROUTES})
    finally:
        fs.release.set()  # the put lands late; its deletion fails, then again in the retry
    assert wait_for(lambda: fs.failures == 0)
    assert wait_for(lambda: fs.find(ROOT) == [], 10)  # the background retry deleted it


def test_without_a_timeout_a_write_waits_for_the_store(store):
    store.hold = "publish"
    threading.Timer(2 * TIMEOUT, store.release.set).start()
    (segment,) = PayloadWriter(ROOT, fs=store, timeout=None).write(1, {"routes": ROUTES})
    assert store.waiting.is_set()
    np.testing.assert_array_equal(PayloadReader(ROOT, fs=store).read([segment])["routes"], ROUTES)


def test_a_store_answering_within_the_timeout_writes_block_by_block(store):
    (segment,) = PayloadWriter(ROOT, fs=store, timeout=TIMEOUT).write(1, {"routes": ROUTES})
    assert store.published == [f"{ROOT}/{segment.file}"]
    np.testing.assert_array_equal(PayloadReader(ROOT, fs=store).read([segment])["routes"], ROUTES)


def test_a_local_root_writes_without_any_deadline_call(tmp_path, monkeypatch):
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a local-backed root's write went through a deadline")

    monkeypatch.setattr(writer_module, "within", refused)
    monkeypatch.setattr(upload_module, "within", refused)
    monkeypatch.setattr(upload_module, "bounded", refused)
    monkeypatch.setattr(deadline, "within", refused)
    (segment,) = PayloadWriter(tmp_path, timeout=TIMEOUT).write(1, {"routes": ROUTES})
    assert (tmp_path / segment.file).stat().st_size > ROUTES.nbytes


def test_a_cleanup_dropped_past_the_limit_while_it_is_tried_leaves_the_thread_serving(
    monkeypatch,
):
    """The oldest pending cleanup is given up when the limit is passed, even while the
    background thread is trying it: the thread must go on with the others."""
    monkeypatch.setattr(abort_retry, "MAX_PENDING_CLEANUPS", 1)
    root = PayloadRoot(ROOT, fs=SlowMemory(), timeout=0.05)
    cleanups = abort_retry._Cleanups()
    trying, release = threading.Event(), threading.Event()
    aborted: list[str] = []

    def held_abort() -> None:
        trying.set()
        release.wait(5)

    cleanups.add(abort_retry._Cleanup("first", held_abort, root, f"{ROOT}/v1/a.bin"))
    assert trying.wait(5)
    second = abort_retry._Cleanup("second", lambda: aborted.append("second"), root, "/run/b")
    cleanups.add(second)  # past the limit: the first, being tried, is given up
    release.set()
    assert wait_for(lambda: aborted == ["second"])
    assert wait_for(lambda: cleanups.pending() == 0)


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")


@pytest.mark.parametrize(
    ("status", "code", "refused"),
    [
        (403, "AccessDenied", True),
        (404, "NoSuchBucket", True),
        (400, "InvalidRequest", True),
        (500, "InternalError", False),
        (503, "SlowDown", False),
    ],
)
def test_only_a_store_answered_4xx_counts_as_refused_raw_or_as_s3fs_translates_it(
    status, code, refused
):
    """A 4xx the store answered leaves nothing to land later, whether botocore's error or the
    Python one s3fs translates it into; a 5xx may follow an applied put."""
    from s3fs.errors import translate_boto_error

    error = _client_error(status, code)
    assert upload_module._refused(error) is refused
    assert upload_module._refused(translate_boto_error(error)) is refused


def test_a_timeout_a_lost_connection_or_an_interrupt_leaves_the_put_in_doubt():
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    in_doubt = [
        deadline.timed_out("put_object of s3://b/k", 1.0),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        ConnectionResetError(),
        KeyboardInterrupt(),
    ]
    for error in in_doubt:
        assert not upload_module._refused(error), repr(error)
    wrapped = OSError("the put failed")
    wrapped.__cause__ = ConnectionClosedError(endpoint_url="http://127.0.0.1:1")
    assert not upload_module._refused(wrapped)
