"""The payload campaigns on the real S3 store: handle escapes across prefixes and buckets,
writers killed mid-upload, flaky reads, retention schedules with restarts (smaller than the
local ones: every request is a round trip). A full disk has no S3 counterpart here."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # payload_campaigns

import fsspec
import numpy as np
import pytest
from payload_campaigns import (
    Spellings,
    escape_campaign,
    flaky,
    flaky_reads_campaign,
    killed_writer_campaign,
    moved,
    retention_campaign,
    routes,
)
from s3_fixtures import s3_fixture, s3_fs_fixture, s3_root_fixture  # noqa: F401

from r3data.errors import PayloadHandleError, PayloadNotFoundError, PayloadReadError
from r3data.payload import PayloadReader, PayloadRetention, PayloadRoot, PayloadWriter


def test_handles_never_escape_the_prefix_or_the_bucket(s3_root, s3_fs):
    bucket_run = PayloadRoot(s3_root, fs=s3_fs).path
    bucket = bucket_run.split("/")[0]
    data = routes(np.random.default_rng(0), 30)
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": data})
    secret = bytes(segment.offset + segment.nbytes)
    other_bucket = f"{bucket}-x"
    s3_fs.mkdir(other_bucket)
    try:
        planted = {
            f"s3://{bucket}/other/{segment.file}": secret,  # a sibling prefix
            f"s3://{bucket}/run-2/{segment.file}": secret,  # a prefix that starts like the root
            f"s3://{other_bucket}/run/{segment.file}": secret,  # the same key, another bucket
        }
        for url, content in planted.items():
            s3_fs.pipe_file(url, content)
        spellings = Spellings(
            root_prefixes=[f"{bucket_run}/", f"s3://{bucket_run}/", f"/{bucket_run}/"],
            outside={**planted, **{u.removeprefix("s3://"): c for u, c in planted.items()}},
        )
        counts = escape_campaign(
            s3_root,
            s3_fs,
            spellings,
            {segment.file: segment},
            {segment.file: data},
            random.Random(5),
            150,
        )
    finally:
        s3_fs.rm(other_bucket, recursive=True)
    assert counts["read"] > 30, counts
    assert counts["refused"] > 30, counts


def test_writers_killed_mid_upload_never_publish_a_partial_object(s3, s3_root):
    fs = fsspec.filesystem("s3", **s3.storage_options(default_block_size=5 << 20))
    counts = killed_writer_campaign(s3_root, fs, random.Random(6), 4, 20000, 0.4)
    assert counts["published"] > 0, counts
    assert counts["temporary"] == 0, counts  # an object store has no temporary names


def test_flaky_reads_over_s3_return_exact_bytes_or_typed_errors(s3, s3_root):
    import s3fs

    fs = flaky(s3fs.S3FileSystem)(rate=0.12, seed=7, **s3.storage_options())
    counts = flaky_reads_campaign(s3_root, fs, random.Random(7), 80, 5)
    assert counts["ok"] > 10, counts
    assert counts["typed error"] > 3, counts


def test_retention_schedules_with_restarts_on_s3(s3_root, s3_fs):
    totals = {"files": 0, "restarts": 0, "read": 0}
    for case in range(3):
        rng = random.Random(f"s3-{case}")
        counts = retention_campaign(f"{s3_root}/case{case}", s3_fs, rng, 5, rng.randint(0, 2), 0.4)
        totals = {k: totals[k] + counts[k] for k in totals}
    assert totals["read"] > 3, totals


def test_hostile_spellings_on_s3_are_typed_refusals_never_outside_bytes(s3_root, s3_fs):
    """Percent-encoded and backslashed dots, fullwidth dots and slashes, queries, fragments,
    other protocols and the bucket or root themselves: the store's own key handling (SeaweedFS
    refuses a backslash with a Bad Request) never reaches a key outside the root."""
    root = PayloadRoot(s3_root, fs=s3_fs)
    bucket = root.path.split("/")[0]
    inside = b"I" * 64
    s3_fs.pipe_file(f"{root.path}/v1/x.bin", inside)
    s3_fs.pipe_file(f"{bucket}/secret.bin", bytes(64))
    spellings = [
        "%2e%2e/secret.bin",
        "v1/%2e%2e/%2e%2e/secret.bin",
        "..%2fsecret.bin",
        "..\\secret.bin",
        "v1\\..\\..\\secret.bin",
        "\uff0e\uff0e/secret.bin",
        "..\uff0fsecret.bin",
        "v1/x.bin?versionId=x/../../../secret.bin",
        "v1/x.bin#../../../secret.bin",
        f"s3a://{bucket}/secret.bin",
        f"simplecache::s3://{bucket}/secret.bin",
        f"s3://{bucket}",
        f"s3://{bucket}/run",
        f"/{bucket}",
        bucket,
        "v1",
        "\ud800",
        ".../secret.bin",
        "a" * 2000,
    ]
    refusals = (PayloadHandleError, PayloadNotFoundError, PayloadReadError)
    for handle in [*spellings, "v1/./x.bin", f"s3a://{bucket}/run/v1/x.bin"]:
        try:
            with root.open_read(handle) as f:
                got = bytearray(f.size)
                f.read_at(0, memoryview(got))
        except refusals:
            assert handle in spellings, handle
            continue
        assert bytes(got) == inside, handle


def test_a_second_name_of_an_object_cannot_delete_it_early(s3_root, s3_fs):
    """s3fs reads ``key?versionId=...`` as ``key`` (the version dropped unless version-aware),
    and SeaweedFS reads ``v1\\x.bin`` as ``v1/x.bin``: released under such a name, the object
    would go while a later batch still needs it under its own. Such a handle names no plain
    key: refused, on claim and on read."""
    data = routes(np.random.default_rng(9), 8)
    (segment,) = PayloadWriter(s3_root, fs=s3_fs).write(1, {"routes": data})
    root = PayloadRoot(s3_root, fs=s3_fs)
    backslashed = segment.file.replace("/", "\\")
    with s3_fs.open(f"{root.path}/{backslashed}", "rb") as f:  # the store's second name
        assert f.read() == s3_fs.cat_file(f"{root.path}/{segment.file}")
    aliases = {
        f"{segment.file}?versionId=null": "expected a plain key",
        f"{segment.file}?versionId=x/y": "expected a plain key",
        backslashed: "with a backslash, which some stores read as '/'",
    }
    for alias, message in aliases.items():
        with pytest.raises(PayloadHandleError, match=message):
            root.open_read(alias)
    retention = PayloadRetention(s3_root, 8, fs=s3_fs, fresh=False)
    retention.claim(5, [segment.file])
    for alias, message in aliases.items():
        with pytest.raises(PayloadHandleError, match=message):
            retention.claim(2, [alias])
    retention.on_policy_update(2)
    retention.wait()
    assert s3_fs.exists(f"{root.path}/{segment.file}")
    retention.on_policy_update(5)
    retention.close()
    s3_fs.invalidate_cache()
    assert not s3_fs.exists(f"{root.path}/{segment.file}")


def test_a_name_no_store_key_can_be_is_a_handle_error_not_retried(s3_root, s3_fs):
    """A key is UTF-8 of at most 1024 bytes: a lone surrogate (even one ``os.fsdecode`` makes
    of a byte, a local file's name) or a longer name is refused at once, naming it, as on a
    local root; no retry makes it readable."""
    segment = PayloadWriter(s3_root, fs=s3_fs).write(
        1, {"routes": routes(np.random.default_rng(3), 4)}
    )[0]
    reader = PayloadReader(s3_root, fs=s3_fs, retries=3, backoff=1.0, max_backoff=1.0)
    cases = [
        ("v1/\ud800.bin", r"must be a path in utf-8, found 'v1/\\ud800.bin'"),
        ("v1/\udcff.bin", r"must be a path in utf-8, found 'v1/\\udcff.bin'"),
        ("v1/" + "a" * 1100, r"names a key of \d+ bytes: expected at most 1024"),
    ]
    for handle, message in cases:
        started = time.monotonic()
        with pytest.raises(PayloadHandleError, match=message):
            reader.read([moved(segment, handle)])
        assert time.monotonic() - started < 0.5, handle
