"""Payload roots on a real local filesystem and on fsspec's ``memory://``."""

from __future__ import annotations

import uuid

import fsspec
import pytest


@pytest.fixture(params=["local", "memory"])
def payload_root(request, tmp_path):
    """A fresh, empty payload root URL on each filesystem."""
    if request.param == "local":
        yield str(tmp_path / "payloads")
        return
    root = f"memory://r3test-{uuid.uuid4().hex}"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)
