"""``loader``: the whole pipeline from training samples to ``TensorBatch``es.

``SampleSource -> Batcher -> Mapper(stitch every sample, then fill the batch) ->
Prefetcher``, wrapped in a ``torchdata.nodes.Loader`` whose ``state_dict()`` resumes exactly
after the last batch the trainer received. Work is per batch, not per sample, on one
background thread while the trainer computes; the fill spreads its copies, decodes and reads
over the shared pool. Stitching (Python, holding the GIL) and filling are not overlapped with
each other: a fill thread waiting for the GIL behind a stitching thread loses more (every
one of its many short handovers costs a switch interval) than the overlap would win on the
memory bandwidth the fill is bound by.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsspec import AbstractFileSystem
from torchdata.nodes import Batcher, Loader, Mapper, Prefetcher

from r3data.batch import TensorBatch
from r3data.buffers import BufferPool
from r3data.errors import ConfigError
from r3data.nodes.collate import CollateRollouts
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.source import SampleSource
from r3data.nodes.steps import BatchSteps
from r3data.nodes.stitcher import StitchRollout
from r3data.parallel import pool_workers
from r3data.payload.reader import PayloadReader
from r3data.payload.retention import PayloadRetention
from r3data.trace import ROUTES_FIELD, OnGap, Placeholder
from r3data.trace.stitch import check_on_gap
from r3data.validate import checked_int

if TYPE_CHECKING:
    from r3data.layout import TokenLayout

_SCREEN_OPTIONS = ("num_experts", "zero_rows")
_TRACE_OPTIONS = ("routes_field", "ragged_fields", "last_token_row")


class _Failed:
    """An exception raised while preparing a batch, carried to the trainer's thread."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Stage:
    """One stage of the pipeline, applied to a batch. A failure travels as a value through the
    stages that follow, so the trainer gets the original exception (its class, its message,
    the worker's traceback), not a wrapper's, and a ``SystemExit`` in a sample cannot stop a
    worker thread that the pipeline then waits on forever."""

    def __init__(self, work: Callable[[Any], Any]) -> None:
        self.work = work

    def __call__(self, item: Any) -> Any:
        if isinstance(item, _Failed):
            return item
        try:
            return self.work(item)
        except BaseException as exc:
            return _Failed(exc)


def _delivered(batch: TensorBatch | _Failed) -> TensorBatch:
    if isinstance(batch, _Failed):
        raise batch.error
    return batch


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
    buffer_pool: BufferPool | None = None,
) -> Loader[TensorBatch]:
    """A resumable loader of :class:`TensorBatch`es (see :mod:`r3data.nodes.collate`).

    ``samples``: dicts or dataclasses (see :mod:`r3data.nodes.sample`), a list or any
    re-iterable. ``payload_root`` (path or fsspec URL) is needed for by-handle sources.
    ``workers`` bounds the threads that fill a batch (default: the cgroup-aware CPU count);
    with ``prefetch`` > 0 the next batches are stitched and filled in the background, two at a
    time, while the trainer works. With ``retention``, the files of batch k's samples are
    claimed for step ``start_step + k`` as soon as each sample is stitched (before any read),
    so the trainer only calls ``retention.on_policy_update(step)``. With ``layout`` each batch
    is one micro-batch on that rank: stitched fields hold only the rank's rows (rank-local
    reads). ``trace_options``: ``num_experts`` and ``zero_rows`` screen the routes
    (:class:`~r3data.nodes.screen.ScreenOptions`); ``routes_field``, ``ragged_fields`` and
    ``last_token_row`` shape each trace (:class:`~r3data.trace.TraceBuilder`).
    ``buffer_pool`` recycles batch buffers across loaders (one loader per epoch, say); by
    default each loader has its own.
    """
    checked_int("batch_size", batch_size, minimum=1)
    checked_int("prefetch", prefetch)
    threads = checked_int("workers", pool_workers() if workers is None else workers, minimum=1)
    check_on_gap(on_gap)
    options = dict(trace_options or {})
    unknown = sorted(set(options) - set(_SCREEN_OPTIONS) - set(_TRACE_OPTIONS))
    if unknown:
        raise ConfigError(
            f"trace_options: unknown {unknown}; expected some of "
            f"{sorted(_SCREEN_OPTIONS + _TRACE_OPTIONS)}"
        )
    screen = ScreenOptions(**{k: options.pop(k) for k in _SCREEN_OPTIONS if k in options})
    reader = None if payload_root is None else PayloadReader(payload_root, fs=payload_fs)
    steps = BatchSteps(batch_size, start_step)
    stitch = StitchRollout(
        tuple(fields), placeholder, on_gap, topk, options, retention=retention, steps=steps
    )
    collate = CollateRollouts(
        tuple(fields),
        reader,
        pin_memory,
        threads,
        screen=screen,
        on_gap=on_gap,
        routes_field=options.get("routes_field", ROUTES_FIELD),
        layout=layout,
        steps=steps,
        pool=BufferPool() if buffer_pool is None else buffer_pool,
    )
    node = Batcher(SampleSource(samples), batch_size, drop_last=drop_last)
    node = Mapper(node, _Stage(lambda items: collate([stitch(item) for item in items])))
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return Loader(Mapper(node, _delivered), restart_on_stop_iteration=False)
