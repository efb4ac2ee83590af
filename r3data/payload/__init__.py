"""Payloads by handle: segment files on any fsspec filesystem, read concurrently, retained safely.

Inference servers write routes and masks to ``<root>/v<version>/<id>.bin`` and answer with
:class:`PayloadSegment` handles; the trainer reads them with :class:`PayloadReader` and deletes
them with :class:`PayloadRetention` once the batch that used them is trained on.
"""

from r3data.payload.audit import PayloadFileInfo, VerifyReport, inspect, verify
from r3data.payload.fileformat import FORMAT_VERSION, MAGIC, FieldEntry, PayloadHeader, read_header
from r3data.payload.fs import PayloadFile, PayloadRoot
from r3data.payload.reader import PayloadReader, RangeRead, ReadJob
from r3data.payload.retention import (
    GcReport,
    PayloadRetention,
    RetentionMetrics,
    gc,
    min_fresh_version,
)
from r3data.payload.writer import FieldData, PayloadWriter
from r3data.wire.segment import INDEX_DTYPE, PayloadSegment, clip, covers, gaps, shift

__all__ = [
    "FORMAT_VERSION",
    "INDEX_DTYPE",
    "MAGIC",
    "FieldData",
    "FieldEntry",
    "GcReport",
    "PayloadFile",
    "PayloadFileInfo",
    "PayloadHeader",
    "PayloadReader",
    "PayloadRetention",
    "PayloadRoot",
    "PayloadSegment",
    "PayloadWriter",
    "RangeRead",
    "ReadJob",
    "RetentionMetrics",
    "VerifyReport",
    "clip",
    "covers",
    "gaps",
    "gc",
    "inspect",
    "min_fresh_version",
    "read_header",
    "shift",
    "verify",
]
