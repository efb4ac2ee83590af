"""``StitchRollout``: normalise one raw sample and stitch its trace into its fill plan."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3data.errors import ConfigError, with_context
from r3data.nodes.sample import RolloutSample, as_rollout
from r3data.nodes.steps import BatchSteps
from r3data.payload.retention import PayloadRetention
from r3data.trace import OnGap, Placeholder, StitchedSample
from r3data.trace.stitch import check_stitch_options, stitch_checked

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class StitchedRollout:
    """A sample and its stitched fields (None when ``on_gap="drop_sample"`` dropped it)."""

    index: int
    sample: RolloutSample
    stitched: StitchedSample | None


@dataclass(frozen=True)
class StitchRollout:
    """Maps ``(index, raw sample)`` to a :class:`StitchedRollout`; errors name the sample."""

    fields: Sequence[str]
    placeholder: Placeholder = "repeat_previous"
    on_gap: OnGap = "drop_routes"
    topk: int | None = None
    trace_options: Mapping[str, Any] | None = None
    retention: PayloadRetention | None = None
    """Claims each sample's payload files, as soon as it is stitched, for its batch's step."""
    steps: BatchSteps | None = None

    def __post_init__(self) -> None:
        if self.retention is not None and self.steps is None:
            raise ConfigError("StitchRollout with a retention needs steps (BatchSteps)")
        options = check_stitch_options(self.fields, self.placeholder, self.on_gap, self.topk)
        object.__setattr__(self, "_options", options)

    def __call__(self, item: tuple[int, Any]) -> StitchedRollout:
        index, raw = item
        sample_id = str(index)
        try:
            sample_id = _raw_id(raw, index)
            sample = as_rollout(raw, index, self.trace_options)
            if self.retention is not None and sample.files:
                # before any update can release them: a file shared with a batch that is not
                # read yet stays until that batch's step too
                self.retention.claim(self.steps(index), sample.files)
            empty = [f for f in self.fields if f not in sample.trace.info]
            if empty and self.on_gap != "raise":
                # No row of the field anywhere (e.g. every turn's routes were an engine bug):
                # nothing to replay and no row shape for placeholders, so the sample is dropped.
                logger.warning(
                    "sample %r: no rows of %s in any request; sample dropped", sample_id, empty
                )
                return StitchedRollout(index, sample, None)
            stitched = stitch_checked(sample.trace, sample.sample_len, self._options)
        except Exception as exc:
            raise with_context(exc, f"sample {sample_id!r} (index {index})")  # noqa: B904
        return StitchedRollout(index, sample, stitched)


def _raw_id(raw: Any, index: int) -> str:
    for name in ("sample_id", "id"):
        value = raw.get(name) if isinstance(raw, Mapping) else getattr(raw, name, None)
        if value is not None:
            return str(value)
    return str(index)
