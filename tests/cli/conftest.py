"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from written_roots import WrittenRoot, write_root


@pytest.fixture
def written_root(tmp_path: Path) -> WrittenRoot:
    """Three payload files, policy versions 0, 1 and 2, each with routes and a ragged mask."""
    return write_root(tmp_path)
