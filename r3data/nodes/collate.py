"""``CollateRollouts``: stitched samples -> one ``TensorBatch`` with packed fields.

Each field is allocated once at its final size and filled in one pass straight from the wire
or the payload files (:mod:`r3data.nodes.fill`). Fields of the batch, for samples kept:

- each stitched field (``routed_experts`` by default): a :class:`~r3data.packed.PackedTensor`
  ``[total_rows, *row_shape]`` in the narrowest dtype holding every sample's ids; ragged
  fields (sampling masks) stay ragged, a :class:`~r3data.packed_ragged.PackedRagged` (CSR:
  every id once, row offsets; ``.padded()`` on request); and ``<field>_valid`` (bool, True
  where the engine produced the row);
- ``token_ids`` (int64), ``loss_mask`` (bool), ``logprobs`` (float32, when samples carry them);
- ``sample_id``: a list of ids.

With a ``layout`` (rank-local reads), stitched fields and their valid masks hold only the rows
of ``layout.local_ranges(sample lengths)`` of each sample, back to back: by-handle pieces are
clipped before reading, so a rank reads about 1/(CP x TP) of the batch's bytes. They are
:class:`~r3data.layout.RankRows`, which carry the layout and the full sample lengths:
``r3data.layout.expand(batch["routed_experts"])`` reads both (and refuses another layout).

``metadata`` holds ``step`` (the optimizer step), ``micro_batch`` and ``micro_batches`` (this
micro-batch's number in the step, and how many the step has on every data-parallel rank),
``stats`` (:class:`~r3data.trace.StitchStats`), ``index`` and ``files`` (per sample,
:class:`~r3data.batch.PerSample`: its index in the data and its payload files), ``dropped``
(ids of samples dropped by ``on_gap="drop_sample"`` or with no rows at all),
``dropped_files``, ``warnings`` and ``layout``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from r3data.batch import PerSample, TensorBatch
from r3data.buffers import BufferPool
from r3data.errors import SegmentError, with_message
from r3data.layout.rows import RankRows
from r3data.nodes.fill import fill_field
from r3data.nodes.fill_common import FilledField
from r3data.nodes.sample import name_sample
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.source import MicroBatch
from r3data.nodes.stitcher import StitchedRollout
from r3data.packed import PackedTensor
from r3data.packed_ragged import PackedRagged
from r3data.payload.reader import PayloadReader, PlanStop
from r3data.trace import ROUTES_FIELD, StitchedField, StitchStats
from r3data.trace.builder import FieldInfo, clip_source
from r3data.trace.stitch import OnGap
from r3data.wire.dtypes import compact_route_dtype

if TYPE_CHECKING:
    from r3data.layout import TokenLayout

logger = logging.getLogger(__name__)


def _vector_field(values: Sequence[np.ndarray], dtype: torch.dtype) -> PackedTensor:
    lengths = [v.shape[0] for v in values]
    flat = np.concatenate(values) if values else np.zeros(0)
    return PackedTensor.from_lengths(
        torch.from_numpy(np.ascontiguousarray(flat)).to(dtype), lengths
    )


def _empty(form: FieldInfo, dtype: np.dtype) -> PackedTensor | PackedRagged:
    """A field of no sample in ``form``."""
    if form.ragged:
        return PackedRagged.from_samples([], dtype)
    return PackedTensor(torch.from_numpy(np.empty((0, *form.row_shape), dtype)), [0])


def _localized(field: StitchedField, ranges: list[tuple[int, int]]) -> StitchedField:
    """``field`` cut to one sample's local ranges (views and clipped handles; nothing read)."""
    pieces = tuple(
        clip_source(p, max(lo, p.pos), min(hi, p.end))
        for lo, hi in ranges
        for p in field.pieces
        if p.pos < hi and p.end > lo
    )
    return field.with_pieces(pieces)


@dataclass(frozen=True)
class CollateRollouts:
    """Collates a list of :class:`StitchedRollout` into a :class:`TensorBatch`.

    ``screen`` screens the routes field (``routes_field``) as it is filled; with its
    ``num_experts`` the routes are stored in the narrowest dtype holding the ids, else in the
    widest dtype the samples arrived in. Rows the screen finds missing are a gap handled by
    ``on_gap``.
    """

    fields: Sequence[str]
    reader: PayloadReader | None = None
    pin_memory: bool = False
    workers: int | None = None
    screen: ScreenOptions = dataclasses.field(default_factory=ScreenOptions)
    on_gap: OnGap = "drop_routes"
    routes_field: str = ROUTES_FIELD
    layout: TokenLayout | None = None
    pool: BufferPool = dataclasses.field(default_factory=BufferPool, compare=False)
    """Recycles the buffers of batches the trainer has dropped."""

    def __call__(
        self,
        rollouts: Sequence[StitchedRollout] | MicroBatch[StitchedRollout],
        forms: Mapping[str, FieldInfo] | None = None,
        stop: PlanStop | None = None,
    ) -> TensorBatch:
        """One batch of ``rollouts``; a :class:`MicroBatch` adds its step to the metadata.
        ``forms`` (:func:`~r3data.nodes.sample.field_forms`) give a batch without a sample its
        fields' dtype, row shape and raggedness (a field without one: 1-D, uint8). Once
        ``stop`` is set (from any thread), the batch's reads stop at their next call to the
        filesystem and the call raises (the loader sets its thread's stop at a shutdown)."""
        if stop is None:
            return self._collate(rollouts, forms)
        return stop.run(lambda: self._collate(rollouts, forms))

    def _collate(
        self,
        rollouts: Sequence[StitchedRollout] | MicroBatch[StitchedRollout],
        forms: Mapping[str, FieldInfo] | None,
    ) -> TensorBatch:
        micro = rollouts if isinstance(rollouts, MicroBatch) else None
        rollouts = micro.items if micro is not None else rollouts
        kept = [r for r in rollouts if r.stitched is not None]
        ids = [r.sample.sample_id for r in kept]
        if self.layout is None:
            full_lengths = ranges = None
        else:
            full_lengths = np.array([r.sample.sample_len for r in kept], np.int64)
            ranges = self.layout.local_ranges(full_lengths)
        batch_fields: dict = {}
        stats = StitchStats.total([r.stitched for r in rollouts])
        late_drops: set[int] = set()
        warnings = [w for r in rollouts for w in r.warnings]
        warnings += [w for r in kept for w in r.stitched.warnings]
        for name in self.fields:
            if ranges is None:
                stitched = [r.stitched[name] for r in kept]
            else:
                stitched = [_localized(r.stitched[name], ranges[i]) for i, r in enumerate(kept)]
            form = None if kept or forms is None else forms.get(name)
            if form is not None:
                filled = FilledField(_empty(form, self._dtype(name, [], form)), np.zeros(0, bool))
            else:
                filled = self._guarded(kept, name, stitched, ids)
            valid = PackedTensor(torch.from_numpy(filled.valid), filled.values.offsets)
            if self.layout is not None and isinstance(filled.values, PackedTensor):
                batch_fields[name] = RankRows.of(filled.values, self.layout, full_lengths)
                valid = RankRows.of(valid, self.layout, full_lengths)
            else:
                batch_fields[name] = filled.values
            batch_fields[f"{name}_valid"] = valid
            stats += filled.stats
            late_drops.update(filled.dropped)
            for warning in filled.warnings:
                logger.warning(warning)
            warnings.extend(filled.warnings)
        batch_fields["token_ids"] = _vector_field([r.sample.token_ids for r in kept], torch.int64)
        batch_fields["loss_mask"] = _vector_field([r.sample.loss_mask for r in kept], torch.bool)
        with_logprobs = [r.sample.logprobs is not None for r in kept]
        if any(with_logprobs):
            if not all(with_logprobs):
                missing = [r.sample.sample_id for r in kept if r.sample.logprobs is None]
                raise SegmentError(
                    f"logprobs: every sample of a batch needs them, missing in {missing}"
                )
            batch_fields["logprobs"] = _vector_field(
                [r.sample.logprobs for r in kept], torch.float32
            )
        batch_fields["sample_id"] = ids
        dropped = [r for r in rollouts if r.stitched is None] + [
            kept[i] for i in sorted(late_drops)
        ]
        metadata = {
            "stats": stats,
            "index": PerSample([r.index for r in kept]),
            "files": PerSample([r.sample.files for r in kept]),
            "dropped": [r.sample.sample_id for r in dropped],
            "dropped_files": tuple(sorted({f for r in dropped for f in r.sample.files})),
            "warnings": warnings,
        }
        if self.layout is not None:
            metadata["layout"] = self.layout
        if micro is not None:
            metadata.update(step=micro.step, micro_batch=micro.index, micro_batches=micro.count)
        batch = TensorBatch(batch_fields, metadata, batch_size=len(kept))
        if late_drops:
            batch = batch.gather([i for i in range(len(kept)) if i not in late_drops])
            batch.metadata["stats"] = stats + StitchStats(samples_dropped=len(late_drops))
        return batch

    def _dtype(
        self, name: str, stitched: list[StitchedField], form: FieldInfo | None = None
    ) -> np.dtype:
        if name == self.routes_field and self.screen.num_experts is not None:
            return compact_route_dtype(self.screen.num_experts - 1)
        if not stitched:
            return np.dtype(np.uint8) if form is None else form.dtype
        # a ragged field a sample never sent has no dtype of its own: it widens nothing
        sent = [s.dtype for s in stitched if s.sent] or [stitched[0].dtype]
        return np.result_type(*sent)

    def _guarded(self, kept, name, stitched, ids):
        """Fill one field; a failure names the sample it happened in."""
        try:
            return fill_field(
                name,
                stitched,
                dtype=self._dtype(name, stitched),
                reader=self.reader,
                screen=self.screen if name == self.routes_field else None,
                on_gap=self.on_gap,
                sample_ids=ids,
                workers=self.workers,
                pin_memory=self.pin_memory,
                pool=self.pool,
            )
        except Exception as exc:
            index = getattr(exc, "r3data_sample", None)
            if index is None or index >= len(kept):
                raise
            sample = kept[index]
            message = name_sample(str(exc), sample.sample.sample_id, sample.index)
            raise with_message(exc, message) from exc
