"""``CollateRollouts``: stitched samples -> one ``TensorBatch`` with packed fields.

Each packed field is allocated once at its final size and filled in parallel straight from the
wire arrays or the payload files. Fields of the batch, for samples kept:

- each stitched field (``routed_experts`` by default): ``[total_rows, *row_shape]`` in the
  narrowest dtype holding every sample's ids; ragged fields (sampling masks) padded to the
  batch's widest row with -1; and ``<field>_valid`` (bool, True where the engine produced the
  row);
- ``token_ids`` (int64), ``loss_mask`` (bool), ``logprobs`` (float32, when samples carry them);
- ``sample_id``: a list of ids.

With a ``layout`` (rank-local reads), stitched fields and their valid masks hold only the rows
of ``layout.local_ranges(sample lengths)`` of each sample, back to back: by-handle pieces are
clipped before reading, so a rank reads about 1/(CP x TP) of the batch's bytes. Pass them to
``r3data.layout.expand(..., local=True, lengths=batch["token_ids"].lengths)``.

``metadata`` holds ``step`` (the training step of the batch), ``stats`` (:class:`~r3data.trace.StitchStats`), ``files`` (payload files
the kept samples use), ``dropped`` (ids dropped by ``on_gap="drop_sample"``) and
``dropped_files``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from r3data.batch import TensorBatch
from r3data.buffers import BufferPool
from r3data.errors import SegmentError, with_context
from r3data.nodes.fill import pack_field, torch_dtype
from r3data.nodes.screen import RouteScreen
from r3data.nodes.steps import BatchSteps
from r3data.nodes.stitcher import StitchedRollout
from r3data.packed import PackedTensor, aranges
from r3data.parallel import fill_rows
from r3data.payload.reader import PayloadReader
from r3data.trace import ROUTES_FIELD, StitchedField, StitchStats
from r3data.trace.builder import ZeroRows, clip_source
from r3data.trace.materialize import materialize_field
from r3data.wire import MASK_FILL
from r3data.wire.dtypes import compact_route_dtype

if TYPE_CHECKING:
    from r3data.layout import TokenLayout


def _vector_field(values: Sequence[np.ndarray], dtype: torch.dtype) -> PackedTensor:
    lengths = [v.shape[0] for v in values]
    flat = np.concatenate(values) if values else np.zeros(0)
    return PackedTensor.from_lengths(
        torch.from_numpy(np.ascontiguousarray(flat)).to(dtype), lengths
    )


def _localized(
    field: StitchedField, ranges: list[list[tuple[int, int]]] | None, i: int
) -> StitchedField:
    """``field`` cut to sample i's local ranges (views and clipped handles; no bytes read)."""
    if ranges is None:
        return field
    pieces = [
        clip_source(p, max(lo, p.pos), min(hi, p.end))
        for lo, hi in ranges[i]
        for p in field.pieces
        if p.pos < hi and p.end > lo
    ]
    valid = np.concatenate([field.valid[lo:hi] for lo, hi in ranges[i]] or [field.valid[:0]])
    return dataclasses.replace(field, pieces=tuple(pieces), valid=valid)


def _positions(ranges: list[tuple[int, int]]) -> np.ndarray:
    spans = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    return aranges(spans[:, 0], spans[:, 1] - spans[:, 0])


@dataclass(frozen=True)
class CollateRollouts:
    """Collates a list of :class:`StitchedRollout` into a :class:`TensorBatch`.

    With ``num_experts`` the routes field is stored in the narrowest dtype holding the ids
    (inline ids were checked by the trace, by-handle ids are checked once read); without it,
    in the widest dtype the samples arrived in. ``zero_rows`` is the trace's policy, applied
    to by-handle rows here (see :class:`~r3data.nodes.screen.RouteScreen`).
    """

    fields: Sequence[str]
    reader: PayloadReader | None = None
    pin_memory: bool = False
    workers: int | None = None
    num_experts: int | None = None
    zero_rows: ZeroRows = "missing"
    routes_field: str = ROUTES_FIELD
    layout: TokenLayout | None = None
    steps: BatchSteps | None = None
    """Records ``metadata["step"]``, the step the batch is trained (and its files kept) for."""
    pool: BufferPool = dataclasses.field(default_factory=BufferPool, compare=False)
    """Recycles the buffers of batches the trainer has dropped."""

    def __call__(self, rollouts: Sequence[StitchedRollout]) -> TensorBatch:
        kept = [r for r in rollouts if r.stitched is not None]
        dropped = [r for r in rollouts if r.stitched is None]
        ranges = self._local_ranges(kept)
        positions = None if ranges is None else [_positions(r) for r in ranges]
        batch_fields: dict = {}
        for name in self.fields:
            stitched = [_localized(r.stitched[name], ranges, i) for i, r in enumerate(kept)]
            valid = [s.valid.copy() for s in stitched]
            batch_fields[name] = self._guarded(
                kept, lambda s=stitched, n=name, v=valid: self._pack(n, s, kept, v, positions)
            )
            batch_fields[f"{name}_valid"] = _vector_field(valid, torch.bool)
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
        batch_fields["sample_id"] = [r.sample.sample_id for r in kept]
        metadata = {
            "stats": StitchStats.total(r.stitched for r in rollouts),
            "files": tuple(sorted({f for r in kept for f in r.sample.files})),
            "dropped": [r.sample.sample_id for r in dropped],
            "dropped_files": tuple(sorted({f for r in dropped for f in r.sample.files})),
        }
        if self.layout is not None:
            metadata["layout"] = self.layout
        if self.steps is not None and rollouts:
            metadata["step"] = self.steps(rollouts[0].index)
        return TensorBatch(batch_fields, metadata, batch_size=len(kept))

    def _local_ranges(self, kept: list[StitchedRollout]) -> list[list[tuple[int, int]]] | None:
        if self.layout is None:
            return None
        return self.layout.local_ranges([r.sample.sample_len for r in kept])

    def _pack(
        self,
        name: str,
        stitched: list[StitchedField],
        kept: list[StitchedRollout],
        valid: list[np.ndarray],
        positions: list[np.ndarray] | None,
    ) -> PackedTensor:
        if stitched and stitched[0].ragged:
            return self._pack_ragged(stitched, kept, positions)
        row_shapes = {s.row_shape for s in stitched}
        if len(row_shapes) > 1:
            raise SegmentError(
                f"field {name!r}: every sample of a batch needs the same row shape, found "
                f"{sorted(row_shapes)} in samples {[r.sample.sample_id for r in kept]}"
            )
        row_shape = row_shapes.pop() if row_shapes else ()
        routes = name == self.routes_field
        compact = routes and self.num_experts is not None
        if compact:
            dtype = compact_route_dtype(self.num_experts - 1)
        else:
            dtype = np.result_type(*[s.dtype for s in stitched]) if stitched else np.dtype(np.uint8)
        screen = RouteScreen(name, self.num_experts, self.zero_rows) if routes else None
        packed = pack_field(
            name,
            [s.pieces for s in stitched],
            row_shape=row_shape,
            dtype=dtype,
            reader=self.reader,
            workers=self.workers,
            pin_memory=self.pin_memory,
            pool=self.pool,
            check=screen,
            id_limit=self.num_experts if compact else None,
        )
        if screen is not None:
            screen.mark_invalid(valid, positions)
        return packed

    def _pack_ragged(
        self,
        stitched: list[StitchedField],
        kept: list[StitchedRollout],
        positions: list[np.ndarray] | None,
    ) -> PackedTensor:
        """Ragged rows padded to the widest row of the batch (they are small: no fast path)."""

        def materialize(i: int) -> np.ndarray:
            sample = kept[i].sample
            full = materialize_field(stitched[i], sample.sample_len, self.reader, sample.sample_id)
            return full if positions is None else full[positions[i]]

        rows = fill_rows(materialize, len(kept), self.workers)
        width = max((r.shape[1] for r in rows), default=0)
        dtype = np.result_type(*[r.dtype for r in rows]) if rows else np.dtype(np.int32)
        lengths = [r.shape[0] for r in rows]
        out = np.full((sum(lengths), width), MASK_FILL, dtype=dtype)
        cursor = 0
        for r in rows:
            out[cursor : cursor + r.shape[0], : r.shape[1]] = r
            cursor += r.shape[0]
        return PackedTensor.from_lengths(torch.from_numpy(out).to(torch_dtype(dtype)), lengths)

    @staticmethod
    def _guarded(kept: list[StitchedRollout], fill: Callable[[], PackedTensor]) -> PackedTensor:
        """Run ``fill``; a failure names the sample it happened in."""
        try:
            return fill()
        except Exception as exc:
            index = getattr(exc, "r3data_index", None)
            if index is None or index >= len(kept):
                raise
            sample = kept[index]
            raise with_context(  # noqa: B904
                exc, f"sample {sample.sample.sample_id!r} (index {sample.index})"
            )
