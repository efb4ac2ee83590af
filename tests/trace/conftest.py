"""A real local payload root for the trace tests."""

from __future__ import annotations

import pytest

from r3data.payload.reader import PayloadReader
from r3data.payload.writer import PayloadWriter
from r3data.wire.rows import InlineRows


@pytest.fixture
def payload(tmp_path):
    """``(write(inline_rows) -> [segment], reader)`` on a real local payload root."""
    writer = PayloadWriter(tmp_path)

    def write(rows: InlineRows, version: int = 0):
        return writer.write(version, {rows.field: rows.array}, pos=rows.pos)

    return write, PayloadReader(tmp_path, workers=2)
