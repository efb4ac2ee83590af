"""``RouteScreen``: checks route rows read by handle, which no one saw before the read.

Inline rows are checked when their trace is built; by-handle rows only exist once read into
the batch buffer. Expert ids must be below ``num_experts``; rows zero in every entry (a known
engine bug) are refused (``zero_rows="raise"``), kept (``"keep"``), or by default replaced in
the buffer by distinct experts and marked invalid, so they are never replayed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from r3data.errors import TraceError
from r3data.payload.segment import PayloadSegment
from r3data.trace import check_expert_ids, distinct_row, zero_rows
from r3data.trace.builder import ZeroRows


@dataclass
class RouteScreen:
    """Called as ``screen(sample, segment, rows)`` after each by-handle read of routes."""

    field: str
    num_experts: int | None = None
    zero_rows: ZeroRows = "missing"
    invalid: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """(sample, positions) of rows replaced because they were zero."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, sample: int, segment: PayloadSegment, rows: np.ndarray) -> None:
        if self.num_experts is not None:
            check_expert_ids(
                rows, self.num_experts, trace_id=segment.file, field=self.field, pos=segment.pos
            )
        if self.zero_rows == "keep" or rows.shape[0] == 0:
            return
        zero = zero_rows(rows)
        if not zero.any():
            return
        positions = segment.pos + np.flatnonzero(zero)
        if self.zero_rows == "raise":
            raise TraceError(
                f"file {segment.file!r} field {self.field!r}: route rows at positions "
                f"{positions[:8].tolist()} are zero in every layer (an engine bug)"
            )
        rows[zero] = distinct_row(rows.shape[1:], rows.dtype)
        with self._lock:
            self.invalid.append((sample, positions))

    def mark_invalid(self, valid: list[np.ndarray], positions: list[np.ndarray] | None) -> None:
        """Clear ``valid`` where rows were replaced; ``positions[i]`` maps sample i's rows to
        token positions (rank-local batches), None when rows are positions 0..n-1."""
        for sample, at in self.invalid:
            index = at if positions is None else np.searchsorted(positions[sample], at)
            valid[sample][index] = False
