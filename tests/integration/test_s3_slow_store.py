"""A slow S3 store: SeaweedFS behind a real loopback proxy that stalls (accepts connections,
answers nothing) or trickles its answers. With s3fs's own timeouts and retries at their
defaults, a stalled store would hold a read for many minutes; r3data's per-call timeout
turns it into a typed error naming the object within the configured bound, a trickle within
the bound reads exact bytes, and everything works again once the store answers."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # payload_campaigns

import numpy as np
import pytest
from payload_campaigns import stored
from s3_fixtures import s3_fixture, s3_fs_fixture, s3_root_fixture  # noqa: F401
from s3_proxy import SlowProxy
from stalling import wait_for

from r3data.errors import PayloadReadError, PayloadWriteError
from r3data.payload import PayloadReader, PayloadRetention, PayloadRoot, PayloadWriter

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 1.0
SLACK_S = 1.5
"""Scheduling slack on 2 busy cores, over the bound a test asserts."""


@pytest.fixture(name="proxy")
def proxy_fixture(s3: Any) -> Iterator[SlowProxy]:
    proxy = SlowProxy(s3.ports["s3.port"])
    yield proxy
    proxy.close()


def proxied_fs(s3: Any, proxy: SlowProxy, **options: Any) -> Any:
    """s3fs through the proxy with its own timeouts and retries at their defaults (connect 5 s,
    read 15 s, botocore's and s3fs's retries), as a user's filesystem would have them. Its
    client is made here: on a loaded machine that alone can take longer than a test's deadline,
    and no test here times it."""
    import s3fs

    fs = s3fs.S3FileSystem(
        **{**s3.storage_options(endpoint_url=proxy.endpoint), "config_kwargs": {}}, **options
    )
    fs.connect()
    return fs


@pytest.fixture(name="slow_fs")
def slow_fs_fixture(s3: Any, proxy: SlowProxy) -> Any:
    return proxied_fs(s3, proxy)


def slow_writes_fs(s3: Any, proxy: SlowProxy) -> Any:
    """:func:`proxied_fs` with s3fs's smallest block (5 MiB): a file of a few blocks is a
    multipart upload."""
    return proxied_fs(s3, proxy, default_block_size=5 << 20)


def routes(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (rows, 48, 8), dtype=np.uint8)


def test_a_stalled_store_fails_a_read_in_bounded_time_naming_the_object(
    s3_root, s3_fs, slow_fs, proxy
):
    data = routes(400)
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": data})
    reader = PayloadReader(s3_root, fs=slow_fs, timeout=TIMEOUT, retries=1, backoff=0.05)
    out = np.zeros_like(data)
    reader.read_into([segment], out)  # warm: a session and a pooled connection
    np.testing.assert_array_equal(out, data)
    out[:] = 0
    with proxy.mode_for("stall"):
        start = time.monotonic()
        with pytest.raises(PayloadReadError) as caught:
            reader.read_into([segment], out)
        took = time.monotonic() - start
    message = str(caught.value)
    assert f"{s3_root}/{segment.file}" in message
    assert "failed 2 times" in message, message
    assert f"timeout of {TIMEOUT:g} s" in message, message
    assert 2 * TIMEOUT <= took < 2 * TIMEOUT + 0.05 + SLACK_S, took
    assert not out.any()  # nothing of the batch arrived, and nothing arrives later
    reader.read_into([segment], out)  # the store answers again: the same reader reads
    np.testing.assert_array_equal(out, data)


def test_a_read_cut_by_its_deadline_mid_trickle_writes_nothing_later(
    s3_root, s3_fs, slow_fs, proxy
):
    data = routes(2000, seed=1)  # 768 KB: one chunk, far more than a second of this trickle
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": data})
    reader = PayloadReader(s3_root, fs=slow_fs, timeout=TIMEOUT, retries=0)
    out = np.zeros_like(data)
    proxy.trickle_bytes, proxy.trickle_s = 1 << 10, 0.01  # about 100 KB/s
    with proxy.mode_for("trickle"):
        with pytest.raises(PayloadReadError, match=rf"{segment.file} .*timeout of 1 s"):
            reader.read_into([segment], out)
        time.sleep(2 * TIMEOUT)  # the abandoned request's bytes would land by now
    assert not out.any()
    reader.read_into([segment], out)
    np.testing.assert_array_equal(out, data)


def test_a_trickling_store_within_the_timeout_reads_exact_bytes(s3_root, s3_fs, slow_fs, proxy):
    data = [routes(600, seed=2), routes(50, seed=3)]
    segments = [PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": d})[0] for d in data]
    reader = PayloadReader(s3_root, fs=slow_fs, timeout=4 * TIMEOUT, retries=0, workers=2)
    outs = [np.zeros_like(d) for d in data]
    proxy.trickle_bytes, proxy.trickle_s = 16 << 10, 0.02  # about 800 KB/s: 230 KB in 0.3 s
    with proxy.mode_for("trickle"):
        start = time.monotonic()
        reader.read_many([([s], out) for s, out in zip(segments, outs, strict=True)])
        took = time.monotonic() - start
    for got, want in zip(outs, data, strict=True):
        np.testing.assert_array_equal(got, want)
    assert took > 0.2, took  # the answers really trickled


def test_check_sizes_on_a_stalled_store_is_a_typed_error_then_passes(
    s3_root, s3_fs, slow_fs, proxy
):
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": routes(10)})
    reader = PayloadReader(s3_root, fs=slow_fs, timeout=TIMEOUT, retries=1, backoff=0.05)
    with proxy.mode_for("stall"):
        start = time.monotonic()
        with pytest.raises(PayloadReadError) as caught:
            reader.check_sizes([segment])
        took = time.monotonic() - start
    assert f"{s3_root}/{segment.file}" in str(caught.value)
    assert "failed 2 times" in str(caught.value)
    assert caught.value.r3data_segment is segment
    assert took < 2 * TIMEOUT + 0.05 + SLACK_S, took
    reader.check_sizes([segment])


def test_a_stalled_deletion_is_logged_and_retried_never_raised_nor_a_file_lost(
    s3_root, s3_fs, slow_fs, proxy, caplog
):
    writer = PayloadWriter(s3_root, fs=s3_fs)
    released, kept = (writer.write(1, {"routes": routes(5, seed=v)})[0].file for v in (1, 2))
    root = PayloadRoot(s3_root, fs=s3_fs)
    retention = PayloadRetention(s3_root, 5, fs=slow_fs, fresh=False, timeout=TIMEOUT)
    retention.claim(1, [released])
    retention.claim(2, [kept])
    caplog.set_level(logging.WARNING, logger="r3data.payload.retention")
    with proxy.mode_for("stall", only=b"DELETE"):  # lists and reads, never answers a deletion
        start = time.monotonic()
        retention.on_policy_update(1)
        retention.wait()
        took = time.monotonic() - start
        assert stored(root) == {released, kept}
        assert retention.metrics().delete_errors == 1
        assert retention.metrics().files_pending == 1
    assert took < TIMEOUT + SLACK_S, took
    assert any(
        released in r.getMessage() and "retried later" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    with proxy.mode_for("stall"):  # nothing answers: the pass fails as a whole, logged
        retention.on_policy_update(1)
        retention.wait()
        # the deletion held above may reach the store as the proxy passes it on: no assertion
        assert kept in stored(root)
    assert any("sweep of" in r.getMessage() for r in caplog.records)
    retention.on_policy_update(1)  # the store answers: the due file goes, the claimed stays
    retention.wait()
    assert stored(root) == {kept}
    assert retention.metrics().files_pending == 0
    retention.close()


def test_a_stalled_store_fails_a_retention_pass_in_one_timeout_not_one_per_file(
    s3_root, s3_fs, slow_fs, proxy
):
    writer = PayloadWriter(s3_root, fs=s3_fs)
    released = [writer.write(1, {"routes": routes(5, seed=v)})[0].file for v in range(6)]
    root = PayloadRoot(s3_root, fs=s3_fs)
    retention = PayloadRetention(s3_root, 5, fs=slow_fs, fresh=False, timeout=TIMEOUT)
    retention.claim(1, released)
    with proxy.mode_for("stall", only=b"DELETE"):
        start = time.monotonic()
        retention.on_policy_update(1)
        retention.close()  # one deletion's timeout, not six
        took = time.monotonic() - start
        assert retention.metrics().delete_errors == 1
        assert retention.metrics().files_pending == len(released)
    assert took < TIMEOUT + SLACK_S, took
    retention.on_policy_update(1)  # the store answers: every due file goes
    retention.close()
    assert not stored(root) & set(released)
    assert retention.metrics().files_pending == 0


def test_ctrl_c_during_a_stalled_read_ends_the_process_within_the_timeout(s3, s3_root, s3_fs):
    """A real SIGINT to a process whose read stalls: the read stops at its next call instead of
    retrying on, and the interpreter's exit (which joins the pool's threads) waits for one
    call at most."""
    segments = [PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": routes(9)})[0] for _ in "ab"]
    proxy = SlowProxy(s3.ports["s3.port"])
    script = textwrap.dedent(f"""
        import s3fs, sys
        from r3data.payload import PayloadReader, PayloadSegment
        fs = s3fs.S3FileSystem(key={s3.storage_options()["key"]!r},
            secret={s3.storage_options()["secret"]!r}, endpoint_url={proxy.endpoint!r})
        segments = [PayloadSegment(**d) for d in {[s.to_dict() for s in segments]!r}]
        reader = PayloadReader({s3_root!r}, fs=fs, timeout=2, retries=20, backoff=0.01)
        print("reading", flush=True)
        reader.read(segments)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proxy.set_mode("stall")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert child.stdout.readline() == b"reading\n"
            time.sleep(0.5)  # both files' first calls under way
            start = time.monotonic()
            child.send_signal(signal.SIGINT)
            child.wait(timeout=30)
            took = time.monotonic() - start
        finally:
            child.kill()
            child.wait()
    finally:
        proxy.close()
    assert b"KeyboardInterrupt" in child.stderr.read()
    assert took < 2.0 + SLACK_S, took  # not 21 attempts of 2 s per file


def test_a_version_aware_read_reads_the_version_its_open_saw(s3, s3_root, s3_fs):
    """Writers publish unique keys; should a key be published again while a reader holds it
    open, a version-aware s3fs still reads the version the open looked at, chunk after chunk."""
    import s3fs

    bucket = s3_root.removeprefix("s3://").split("/")[0]
    try:
        s3_fs.call_s3(
            "put_bucket_versioning", Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
        )
    except Exception as exc:  # a store without versioning: nothing to pin
        pytest.skip(f"the store keeps no object versions: {exc}")
    fs = s3fs.S3FileSystem(**s3.storage_options(), version_aware=True)
    data = routes(64)
    (segment,) = PayloadWriter(s3_root, fs=fs).write(0, {"routes": data})
    root = PayloadRoot(s3_root, fs, timeout=TIMEOUT)
    handle = root.open_read(segment.file)
    path = f"{root.path}/{segment.file}"
    if not fs.info(path).get("VersionId"):
        pytest.skip("the store returns no version id")
    fs.pipe_file(path, bytes(255 - b for b in fs.cat_file(path)))  # the same key again
    got = bytearray(segment.nbytes)
    assert handle.read_at(segment.offset, memoryview(got)) == segment.nbytes
    assert bytes(got) == data.tobytes()
    fresh = bytearray(segment.nbytes)  # a file opened now reads the newest version
    assert root.open_read(segment.file).read_at(segment.offset, memoryview(fresh)) > 0
    assert bytes(fresh) == bytes(255 - b for b in data.tobytes())


COMPLETION = rb"POST [^ ]*[?&]uploadId="


def never_published(root: PayloadRoot, before: set[str], seconds: float) -> bool:
    """Whether ``root`` holds nothing over ``before`` within ``seconds`` from now, and keeps
    holding nothing for a second more."""
    until = time.monotonic() + seconds
    while stored(root) - before and time.monotonic() < until:
        time.sleep(0.1)
    gone_at = time.monotonic()
    while time.monotonic() < gone_at + 1.0:
        if stored(root) - before:
            return False
        time.sleep(0.1)
    return True


def warm(writer: PayloadWriter, data: np.ndarray) -> None:
    """A first write with no deadline: the filesystem's session and client (half a second
    here, more on 2 busy cores) and pooled connections, which a 1 s bound would not leave a
    first call time for."""
    PayloadWriter(writer.root.path, fs=writer.root.fs, timeout=None).write(1, {"routes": data})


def uploads(s3_fs: Any, s3_root: str) -> list[Any]:
    return s3_fs.list_multipart_uploads(s3_root.removeprefix("s3://").split("/")[0])


@pytest.mark.parametrize(
    ("stalls", "rows", "failing"),
    [
        (b"", 100, "makedirs"),  # nothing answers
        (b"PUT", 100, "put_object"),  # the single put of a small file
        (b"PUT", 20000, "upload_part"),  # a block of a multipart upload
        (re.compile(COMPLETION), 20000, "complete_multipart_upload"),  # the publish
    ],
)
def test_a_write_to_a_stalled_store_fails_typed_in_bounded_time_and_publishes_nothing(
    s3, s3_root, s3_fs, proxy, stalls, rows, failing
):
    data = routes(rows, seed=4)  # 100 rows: 38 KB, one put; 20000: 7.7 MB, two parts
    writer = PayloadWriter(s3_root, fs=slow_writes_fs(s3, proxy), timeout=TIMEOUT)
    warm(writer, data)
    root = PayloadRoot(s3_root, fs=s3_fs)
    before = stored(root)
    with proxy.mode_for("stall", only=stalls):
        start = time.monotonic()
        with pytest.raises(PayloadWriteError) as caught:
            writer.write(1, {"routes": data})
        took = time.monotonic() - start
        assert stored(root) == before
    message = str(caught.value)
    assert message.startswith(f"writing payload file {s3_root}/v1/"), message
    assert f"{failing} of {s3_root}/v1" in message, message
    assert f"no answer within the timeout of {TIMEOUT:g} s" in message, message
    # the stalled call, the abort of its upload, the look for what it left
    assert took < 3 * TIMEOUT + SLACK_S, took
    assert never_published(root, before, 5 * TIMEOUT)  # the store answers again
    assert not uploads(s3_fs, s3_root)  # the multipart upload, if any, was aborted
    assert len(writer.write(1, {"routes": data})) == 1  # the same writer writes again


def test_a_completion_the_network_held_past_its_deadline_is_undone_once_the_store_answers(
    s3, s3_root, s3_fs, proxy, caplog
):
    """The store answers neither the completion nor the abort: the proxy holds the completion's
    request and hands it to the store once it answers again, after the writer was told the
    write failed. The abort, tried again in the background, then the deletion undo it."""
    data = routes(20000, seed=5)
    writer = PayloadWriter(s3_root, fs=slow_writes_fs(s3, proxy), timeout=TIMEOUT)
    warm(writer, data)
    root = PayloadRoot(s3_root, fs=s3_fs)
    before = stored(root)
    caplog.set_level(logging.WARNING, logger="r3data.payload.abort_retry")
    with proxy.mode_for("stall", only=re.compile(rb"DELETE|" + COMPLETION)):
        with pytest.raises(
            PayloadWriteError, match=r"complete_multipart_upload of .*timeout of 1 s"
        ):
            writer.write(1, {"routes": data})
        assert stored(root) == before
    assert "did not confirm the abort" in caplog.text
    assert never_published(root, before, 10 * TIMEOUT)  # it may show for a moment
    assert not uploads(s3_fs, s3_root)


def test_a_put_whose_body_the_network_held_past_its_deadline_is_deleted_once_it_lands(
    s3, s3_root, s3_fs, proxy
):
    """The store answers the single put's ``100 Continue`` and then takes none of its body:
    the proxy holds the body and hands it to the store once it answers again, after the writer
    was told the write failed. No abort can stop a put: its final name is watched, and what
    lands is deleted."""
    data = routes(100, seed=6)  # 38 KB: one put
    writer = PayloadWriter(s3_root, fs=slow_writes_fs(s3, proxy), timeout=TIMEOUT)
    warm(writer, data)
    root = PayloadRoot(s3_root, fs=s3_fs)
    before = stored(root)
    with proxy.mode_for("stall", only=b"PUT", bodies=True):
        with pytest.raises(PayloadWriteError, match=r"put_object of .*timeout of 1 s"):
            writer.write(1, {"routes": data})
        assert stored(root) == before
    assert never_published(root, before, 10 * TIMEOUT)  # it may show for a moment


def test_a_put_the_store_refused_is_reported_and_not_watched(s3, s3_root, s3_fs, caplog):
    """A put the store answered with a refusal (403: this identity may read, not write) cannot
    land later: the write fails at once, naming the refusal, and no background watch of its
    final name starts."""
    import s3fs
    from s3_server import READER_KEY, READER_SECRET

    reader = s3fs.S3FileSystem(**s3.storage_options(key=READER_KEY, secret=READER_SECRET))
    reader.ls(s3_root.removeprefix("s3://").split("/")[0])  # makes the client: no deadline here
    # no stall in this test: a deadline generous enough for a loaded machine's first request
    writer = PayloadWriter(s3_root, fs=reader, timeout=30 * TIMEOUT)
    caplog.set_level(logging.WARNING, logger="r3data.payload.abort_retry")
    with pytest.raises(PayloadWriteError, match=r"Access ?Denied|[Pp]ermission") as caught:
        writer.write(1, {"routes": routes(100, seed=7)})
    assert isinstance(caught.value.__cause__, PermissionError), repr(caught.value.__cause__)
    assert "did not confirm the put" not in caplog.text, caplog.text
    assert stored(PayloadRoot(s3_root, fs=s3_fs)) == set()


CREATION = rb"POST [^ ]*[?&]uploads(?:[=& ]|$)"


def test_an_upload_whose_creation_the_network_held_past_its_deadline_is_aborted_once_made(
    s3, s3_root, s3_fs, proxy, caplog
):
    """The store takes none of a multipart upload's creation in time: the write fails with no
    upload id to abort, and the proxy hands the creation to the store once it answers again,
    which makes an upload nobody holds the id of. The key's uploads, listed in the background,
    are aborted: none is left to the store's lifecycle rule."""
    data = routes(20000, seed=8)  # 7.7 MB: a multipart upload
    writer = PayloadWriter(s3_root, fs=slow_writes_fs(s3, proxy), timeout=TIMEOUT)
    warm(writer, data)
    root = PayloadRoot(s3_root, fs=s3_fs)
    before = stored(root)
    caplog.set_level(logging.INFO, logger="r3data.payload")
    failed = pytest.raises(PayloadWriteError, match=r"create_multipart_upload of .*timeout of 1 s")
    with proxy.mode_for("stall", only=re.compile(CREATION)), failed:
        writer.write(1, {"routes": data})
    assert "did not confirm the creation of the multipart upload" in caplog.text
    assert wait_for(lambda: "that a late creation made" in caplog.text, 10 * TIMEOUT)
    assert not uploads(s3_fs, s3_root)
    assert stored(root) == before
