"""Payload roots on a real S3 store (SeaweedFS through s3fs): writes, ranged and concurrent
reads, checksums, retention, the CLI on ``s3://`` URLs, credentials, and the store failing."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # payload_campaigns

import fsspec
import numpy as np
import pytest
from payload_campaigns import stored
from s3_fixtures import s3_fixture, s3_fs_fixture, s3_root_fixture  # noqa: F401

from r3data.cli import main
from r3data.errors import (
    PayloadChecksumError,
    PayloadHandleError,
    PayloadNotFoundError,
    PayloadPermissionError,
    PayloadReadError,
)
from r3data.payload import (
    PayloadReader,
    PayloadRetention,
    PayloadRoot,
    PayloadSegment,
    PayloadWriter,
    clip,
    gc,
    verify,
)


def rollout(rng: np.random.Generator, rows: int) -> dict[str, Any]:
    routes = rng.integers(0, 128, (rows, 48, 8), dtype=np.uint8)
    mask = [np.arange(int(n), dtype=np.int32) for n in rng.integers(0, 9, rows)]
    return {"routes": routes, "mask": mask}


def files_under(fs: Any, url: str) -> set[str]:
    """Objects under ``url``, root-relative (files only: emptied "directories" do not count)."""
    return stored(PayloadRoot(url, fs=fs))


class Requests:
    """Every S3 call the filesystem's client makes: (operation, bytes in the response body)."""

    def __init__(self, fs: Any) -> None:
        self.calls: list[list[Any]] = []
        fs.connect() if hasattr(fs, "connect") else None
        fs.s3.meta.events.register("before-call.s3", self._before)
        fs.s3.meta.events.register("after-call.s3", self._after)

    def _before(self, event_name: str, **kwargs: Any) -> None:
        self.calls.append([event_name.rsplit(".", 1)[-1], 0])

    def _after(self, event_name: str, parsed: dict[str, Any], **kwargs: Any) -> None:
        if event_name.endswith("GetObject"):
            self.calls[-1][1] = parsed.get("ContentLength", 0)


def test_writer_puts_and_reader_reads_ranges_concurrently(s3, s3_root):
    fs = fsspec.filesystem("s3", **s3.storage_options(default_block_size=5 << 20))
    rng = np.random.default_rng(0)
    writer = PayloadWriter(s3_root, fs=fs)
    data = [rollout(rng, rows) for rows in (50, 400, 3, 17000, 90)]  # 17000 rows: multipart
    segments = [writer.write(1, fields, pos=10) for fields in data]
    assert len(files_under(fs, s3_root)) == len(data)
    reader = PayloadReader(s3_root, fs=fs, workers=4)
    outs, jobs = [], []
    for (routes, _), fields in zip(segments, data, strict=True):
        lo, hi = 10 + routes.rows // 3, 10 + routes.rows - routes.rows // 4
        want = fields["routes"][lo - 10 : hi - 10]
        outs.append((np.empty_like(want), want))
        jobs.append((clip([routes], lo, hi), outs[-1][0]))
    reader.read_many(jobs)
    for got, want in outs:
        np.testing.assert_array_equal(got, want)
    whole = reader.read([s for pair in segments for s in pair])  # checksums verified
    np.testing.assert_array_equal(whole["routes"], np.concatenate([d["routes"] for d in data]))
    np.testing.assert_array_equal(
        whole["mask"].values, np.concatenate([np.concatenate(d["mask"]) for d in data])
    )


def test_a_small_ranged_read_fetches_only_its_bytes(s3_root, s3_fs):
    big = {"routes": np.zeros((30000, 48, 8), np.uint8)}  # 11.5 MB
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(0, big)
    requests = Requests(s3_fs)
    row = clip([segment], 12345, 12346)
    PayloadReader(s3_root, fs=s3_fs).read(row)
    assert requests.calls == [["HeadObject", 0], ["GetObject", 384]]


def test_a_flipped_byte_is_a_checksum_error_naming_the_object(s3_root, s3_fs):
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(
        0, {"routes": np.ones((9, 48, 8), np.uint8)}
    )
    path = f"{PayloadRoot(s3_root, fs=s3_fs).path}/{segment.file}"
    data = bytearray(s3_fs.cat_file(path))
    data[segment.offset + 100] ^= 1
    s3_fs.pipe_file(path, bytes(data))
    with pytest.raises(
        PayloadChecksumError, match=f"checksum mismatch in {s3_root}/{segment.file}"
    ):
        PayloadReader(s3_root, fs=s3_fs).read([segment])
    assert list(verify(s3_root, fs=s3_fs).corrupt) == [segment.file]


def test_handles_naming_the_bucket_read_the_same_object(s3_root, s3_fs):
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(
        3, {"routes": np.ones((4, 48, 8), np.uint8)}
    )
    bucket_key = f"{PayloadRoot(s3_root, fs=s3_fs).path}/{segment.file}"
    s3_fs.pipe_file(bucket_key.replace("/run/", "/other/"), s3_fs.cat_file(bucket_key))
    reader = PayloadReader(s3_root, fs=s3_fs, retries=0)
    for handle in (segment.file, bucket_key, f"s3://{bucket_key}", f"/{bucket_key}"):
        moved = PayloadSegment(**{**segment.to_dict(), "file": handle})
        assert reader.read([moved])["routes"].sum() == 4 * 48 * 8
    outside = PayloadSegment(
        **{**segment.to_dict(), "file": f"s3://{bucket_key}".replace("/run/", "/other/")}
    )
    with pytest.raises(PayloadHandleError, match="outside the root"):
        reader.read([outside])


def test_retention_deletes_on_consume_and_sweeps_stale_versions(s3_root, s3_fs):
    writer = PayloadWriter(s3_root, fs=s3_fs)
    rng = np.random.default_rng(1)
    files = {v: writer.write(v, rollout(rng, 5))[0].file for v in (0, 1, 2, 3)}
    with PayloadRetention(s3_root, 1, fs=s3_fs, fresh=False) as retention:
        retention.claim(2, [files[1]])  # a late batch still needs a version-1 file
        retention.on_policy_update(1)  # bound 1: version 0 goes, the claimed file stays
        retention.wait()
        assert files_under(s3_fs, s3_root) == {files[1], files[2], files[3]}
        retention.on_policy_update(2)  # releases the claim; bound 2 sweeps version 1
        retention.wait()
        assert files_under(s3_fs, s3_root) == {files[2], files[3]}
        # the store may or may not still list v0/ and v1/ (SeaweedFS does for a while): a sweep
        # over them is harmless either way
        retention.on_policy_update(5)
    assert files_under(s3_fs, s3_root) == set()
    metrics = retention.metrics()
    assert (metrics.files_deleted, metrics.delete_errors, metrics.files_live) == (4, 0, 0)
    report = gc(s3_root, 9, 0, fs=s3_fs)
    assert (report.files, report.errors) == ([], [])
    assert verify(s3_root, fs=s3_fs).files_checked == 0


def test_a_fresh_run_keeps_what_its_writer_published_first(s3_root, s3_fs):
    writer = PayloadWriter(s3_root, fs=s3_fs)
    mine = writer.write(0, {"routes": np.ones((2, 48, 8), np.uint8)})[0].file
    PayloadRetention(s3_root, 1, fs=s3_fs, fresh=True).close()  # this process started earlier
    assert files_under(s3_fs, s3_root) == {mine}
    PayloadRetention(s3_root, 1, fs=s3_fs, fresh=True, run_started=time.time() + 5).close()
    assert files_under(s3_fs, s3_root) == set()


def test_cli_verify_gc_and_inspect_on_the_url_with_credentials_from_the_environment(
    s3, s3_root, s3_fs, monkeypatch, capsys
):
    import s3fs

    writer = PayloadWriter(s3_root, fs=s3_fs)
    rng = np.random.default_rng(2)
    files = [writer.write(v, rollout(rng, 20))[0].file for v in (0, 1, 2)]
    for name, value in s3.environment().items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a plain s3:// URL builds its own, from the env
    assert main(["verify", s3_root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["files_checked"], report["versions"], report["ok"]) == (3, [0, 1, 2], True)
    assert main(["inspect", f"{s3_root}/{files[1]}", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["version"]) == ("payload file", 1)
    assert [f["field"] for f in info["fields"]] == ["routes", "mask"]
    assert main(["inspect", s3_root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["versions"] == [0, 1, 2]
    assert main(["gc", s3_root, "--step", "1", "--max-off-policy-steps", "0", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["files"]) == sorted(files[:2])
    assert files_under(s3_fs, s3_root) == {files[2]}
    # no fs: the writer and the reader find credentials and endpoint in the environment
    written = PayloadWriter(s3_root).write(4, {"routes": np.full((3, 48, 8), 7, np.uint8)})
    assert PayloadReader(s3_root).read(written)["routes"].sum() == 7 * 3 * 48 * 8


def test_an_empty_prefix_is_an_empty_root(s3, s3_root, s3_fs, monkeypatch, capsys):
    """AWS drops an emptied prefix at once, SeaweedFS lists it for a while: neither matters."""
    import s3fs

    never_written = s3_root + "-empty"
    assert verify(never_written, fs=s3_fs).files_checked == 0
    assert gc(never_written, 3, 0, fs=s3_fs).files == []
    for name, value in s3.environment().items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    assert main(["verify", never_written]) == 0
    assert "0 payload files checked" in capsys.readouterr().out
    with pytest.raises(PayloadNotFoundError, match="no-such-bucket"):
        verify("s3://r3-no-such-bucket/run", fs=s3_fs)


def test_credentials_through_storage_options(s3, s3_root):
    fs, _ = fsspec.core.url_to_fs(s3_root, **s3.storage_options())
    (segment,) = PayloadWriter(s3_root, fs=fs).write(0, {"routes": np.ones((3, 48, 8), np.uint8)})
    assert PayloadReader(s3_root, fs=fs).read([segment])["routes"].shape == (3, 48, 8)


def test_missing_objects_and_bad_credentials_each_have_their_own_error(s3, s3_root, s3_fs):
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(
        0, {"routes": np.ones((3, 48, 8), np.uint8)}
    )
    gone = PayloadSegment(**{**segment.to_dict(), "file": "v0/gone.bin"})
    with pytest.raises(
        PayloadNotFoundError, match=rf"{s3_root}/v0/gone\.bin does not exist \(tried 2"
    ):
        PayloadReader(s3_root, fs=s3_fs, retries=1, backoff=0.01).read([gone])
    wrong = fsspec.filesystem("s3", **s3.storage_options(secret="not-the-secret"))
    anonymous = fsspec.filesystem(
        "s3", anon=True, endpoint_url=s3.endpoint, skip_instance_cache=True
    )
    for fs in (wrong, anonymous):
        with pytest.raises(
            PayloadPermissionError, match=rf"{s3_root}/{segment.file} may not be read"
        ):
            PayloadReader(s3_root, fs=fs, retries=3).read([segment])


def test_the_store_killed_mid_batch_then_restarted(s3, s3_root, s3_fs):
    writer = PayloadWriter(s3_root, fs=s3_fs)
    rng = np.random.default_rng(3)
    data = [rollout(rng, 200)["routes"] for _ in range(6)]
    segments = [writer.write(1, {"routes": d})[0] for d in data]
    requests = Requests(s3_fs)
    killed = threading.Event()

    def kill_at_the_third_read(event_name: str, **kwargs: Any) -> None:
        reads = sum(op == "GetObject" for op, _ in requests.calls)
        if event_name.endswith("GetObject") and reads == 3 and not killed.is_set():
            killed.set()
            s3.kill()

    s3_fs.s3.meta.events.register("before-call.s3", kill_at_the_third_read)
    reader = PayloadReader(s3_root, fs=s3_fs, workers=1, retries=2, backoff=0.05)
    outs = [np.zeros_like(d) for d in data]
    try:
        with pytest.raises(PayloadReadError, match=rf"{s3_root}/v1/\w+\.bin .*failed 3 times"):
            reader.read_many([([s], out) for s, out in zip(segments, outs, strict=True)])
        assert killed.is_set()
    finally:  # back once the batch's objects read again (volumes re-register after the gateway)
        s3.restart(readable=tuple(f"{s3_root[len('s3://') :]}/{s.file}" for s in segments))
    reader.read_many([([s], out) for s, out in zip(segments, outs, strict=True)])
    for got, want in zip(outs, data, strict=True):
        np.testing.assert_array_equal(got, want)
