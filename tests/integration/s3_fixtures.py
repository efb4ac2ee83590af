"""Pytest fixtures of the S3 suite: the SeaweedFS store, a filesystem on it, a fresh root.

Import them into a test module (``from s3_fixtures import s3_fs_fixture, ...``); the fixtures
are named ``s3``, ``s3_fs`` and ``s3_root``. The store starts once per session even when
several modules import the fixture; its log is printed at the end of the session when a test
failed while it ran, and kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import s3_server
from realparts import unavailable
from server_helpers import session_server


@pytest.fixture(scope="session", name="s3")
def s3_fixture(
    tmp_path_factory: pytest.TempPathFactory, request: Any
) -> Iterator[s3_server.SeaweedServer]:
    """SeaweedFS on loopback for the session, anonymous requests refused."""
    try:
        import s3fs  # noqa: F401  (the extra `s3`)
    except ImportError:
        unavailable("s3fs is not installed (pip install 'r3data[s3]')")
    reason = s3_server.missing_environment()
    if reason is not None:
        unavailable(reason)
    yield from session_server(
        request,
        "SeaweedFS",
        lambda: s3_server.start(tmp_path_factory.mktemp("seaweedfs")),
        lambda server: server.endpoint,
        tail_lines=60,
    )


@pytest.fixture(name="s3_fs")
def s3_fs_fixture(s3: s3_server.SeaweedServer) -> Any:
    """An s3fs filesystem on the store with the access key (its own instance: no shared
    listing cache with other tests)."""
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options())


@pytest.fixture(name="s3_root")
def s3_root_fixture(s3_fs: Any) -> Iterator[str]:
    """``s3://<fresh bucket>/run``: a payload root of its own for each test, removed after."""
    bucket = f"r3-{uuid.uuid4().hex[:12]}"
    s3_fs.mkdir(bucket)
    yield f"s3://{bucket}/run"
    s3_fs.rm(bucket, recursive=True)
