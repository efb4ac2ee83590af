"""``loader``: the whole pipeline from training samples to ``TensorBatch``es.

``SampleSource -> ParallelMapper(StitchRollout) -> Batcher -> Mapper(CollateRollouts)
-> Prefetcher``, wrapped in a ``torchdata.nodes.Loader`` whose
``state_dict()`` resumes exactly after the last batch the trainer received.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsspec import AbstractFileSystem
from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, Prefetcher

from r3data.batch import TensorBatch
from r3data.errors import ConfigError
from r3data.nodes.collate import CollateRollouts
from r3data.nodes.source import SampleSource
from r3data.nodes.steps import BatchSteps
from r3data.nodes.stitcher import StitchRollout
from r3data.parallel import pool_workers
from r3data.payload.reader import PayloadReader
from r3data.payload.retention import PayloadRetention
from r3data.trace import ROUTES_FIELD, OnGap, Placeholder

if TYPE_CHECKING:
    from r3data.layout import TokenLayout


def loader(
    samples: Sequence[Any] | Iterable[Any],
    *,
    batch_size: int,
    fields: Sequence[str] = (ROUTES_FIELD,),
    payload_root: str | os.PathLike[str] | None = None,
    payload_fs: AbstractFileSystem | None = None,
    retention: PayloadRetention | None = None,
    workers: int | None = None,
    pin_memory: bool = False,
    prefetch: int = 2,
    drop_last: bool = False,
    placeholder: Placeholder = "repeat_previous",
    on_gap: OnGap = "drop_routes",
    topk: int | None = None,
    trace_options: Mapping[str, Any] | None = None,
    start_step: int = 0,
    layout: TokenLayout | None = None,
) -> Loader[TensorBatch]:
    """A resumable loader of :class:`TensorBatch`es (see :mod:`r3data.nodes.collate`).

    ``samples``: dicts or dataclasses (see :mod:`r3data.nodes.sample`), a list or any
    re-iterable. ``payload_root`` (path or fsspec URL) is needed for by-handle sources.
    ``workers`` bounds the stitching threads and the parallel fills (default: the
    cgroup-aware CPU count for stitching and inline fills, the I/O worker count for reads). With ``retention``, the files of batch k's samples are claimed
    for step ``start_step + k`` as soon as each sample is stitched (before any read), so the
    trainer only calls ``retention.on_policy_update(step)``. With ``layout`` each batch is one
    micro-batch on that rank: stitched fields hold only the rank's rows (rank-local reads).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, found {batch_size!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"prefetch must be an int >= 0, found {prefetch!r}")
    threads = pool_workers() if workers is None else workers
    if threads < 1:
        raise ConfigError(f"workers must be >= 1, found {workers}")
    reader = None if payload_root is None else PayloadReader(payload_root, fs=payload_fs)
    steps = BatchSteps(batch_size, start_step)
    stitch = StitchRollout(
        tuple(fields), placeholder, on_gap, topk, trace_options, retention=retention, steps=steps
    )
    node = SampleSource(samples)
    if threads > 1:
        node = ParallelMapper(node, stitch, num_workers=threads, method="thread", in_order=True)
    else:
        node = Mapper(node, stitch)
    node = Batcher(node, batch_size, drop_last=drop_last)
    options = dict(trace_options or {})
    collate = CollateRollouts(
        tuple(fields),
        reader,
        pin_memory,
        workers,
        num_experts=options.get("num_experts"),
        zero_rows=options.get("zero_rows", "missing"),
        routes_field=options.get("routes_field", ROUTES_FIELD),
        layout=layout,
        steps=steps,
    )
    node = Mapper(node, collate)
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return Loader(node, restart_on_stop_iteration=False)
