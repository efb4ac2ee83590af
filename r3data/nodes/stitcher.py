"""``StitchRollout``: normalise one raw sample and stitch its trace into its fill plan."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r3data.errors import ConfigError, TraceError, with_message
from r3data.nodes.options import TraceOptions
from r3data.nodes.sample import RolloutSample, as_rollout, name_sample
from r3data.payload.retention import PayloadRetention
from r3data.trace import ROUTES_FIELD, StitchedSample, Trace
from r3data.trace.stitch import check_stitch_options, stitch_checked

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class StitchedRollout:
    """A sample and its stitched fields (None when ``on_gap="drop_sample"`` dropped it)."""

    index: int
    sample: RolloutSample
    stitched: StitchedSample | None
    warnings: tuple[str, ...] = ()
    """What the stitch stage logged about the sample (a length mismatch, a drop)."""


def covered_tokens(trace: Trace) -> int:
    """Tokens the trace's requests cover: the longest ``prompt_len + completion_len``."""
    return max(map(sum, trace.requests), default=0)


@dataclass(frozen=True)
class StitchRollout:
    """Maps ``(index, raw sample)`` to a :class:`StitchedRollout`; errors name the sample.

    With a ``retention``, a sample's payload files are claimed for the optimizer ``step`` of
    its micro-batch as soon as it is stitched, before any read (a stream's claims; a map-style
    source claims every file up front, see :class:`~r3data.nodes.source.StepSource`).
    """

    fields: Sequence[str] = (ROUTES_FIELD,)
    trace: TraceOptions = dataclasses.field(default_factory=TraceOptions)
    retention: PayloadRetention | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.trace, TraceOptions):
            raise ConfigError(f"trace: expected TraceOptions, found {type(self.trace).__name__}")
        trace = self.trace
        options = check_stitch_options(self.fields, trace.placeholder, trace.on_gap, trace.topk)
        object.__setattr__(self, "_options", options)  # checked once, for every sample
        object.__setattr__(self, "_field_names", frozenset(options[0]))

    def __call__(self, item: tuple[int, Any], step: int | None = None) -> StitchedRollout:
        index, raw = item
        sample = as_rollout(raw, index, self.trace)  # its errors name the sample already
        try:
            return self._stitched(index, sample, step)
        except Exception as exc:
            raise with_message(exc, name_sample(str(exc), sample.sample_id, index)) from exc

    def _stitched(self, index: int, sample: RolloutSample, step: int | None) -> StitchedRollout:
        if self.retention is not None and sample.files:
            if step is None:
                raise ConfigError("StitchRollout with a retention needs the step of each sample")
            # a later sample of the stream may name a file too: its release leaves it to the sweep
            self.retention.claim(step, sample.files, delete_on_release=False)
        warnings = self._length_warnings(sample, index)
        trace = sample.trace
        empty = self._field_names.difference(trace.info, trace.ragged_fields)
        if empty and self.trace.on_gap != "raise":
            empty = [f for f in self._options[0] if f in empty]
            # No row of the field anywhere (e.g. every turn's routes were an engine bug):
            # nothing to replay and no row shape for placeholders, so the sample is dropped.
            warning = name_sample(
                f"no rows of {empty} in any request; sample dropped", sample.sample_id, index
            )
            logger.warning(warning)
            return StitchedRollout(index, sample, None, (*warnings, warning))
        stitched = stitch_checked(sample.trace, sample.sample_len, self._options)
        return StitchedRollout(index, sample, stitched, warnings)

    def _length_warnings(self, sample: RolloutSample, index: int) -> tuple[str, ...]:
        """``token_ids`` longer than the requests cover get placeholders with no gap; shorter
        ones cut the trace: either way the sample and its trace disagree."""
        if self.trace.length_mismatch == "ignore" or not sample.trace.requests:
            return ()
        covered = covered_tokens(sample.trace)
        if covered == sample.sample_len:
            return ()
        message = (
            f"{sample.sample_len} token_ids, but its requests cover {covered} tokens "
            f"({'placeholders after' if sample.sample_len > covered else 'the trace cut at'} "
            f"position {min(covered, sample.sample_len)})"
        )
        if self.trace.length_mismatch == "raise":
            raise TraceError(f"{message}; expected equal counts (length_mismatch='raise')")
        warning = name_sample(message, sample.sample_id, index)
        logger.warning(warning)
        return (warning,)
