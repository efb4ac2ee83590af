"""``loader``: the whole pipeline from training samples to this rank's micro-batches.

``StepSource -> Mapper(stitch every sample, then fill the micro-batch) -> Prefetcher``, wrapped
in a ``torchdata.nodes.Loader`` whose ``state_dict()`` resumes exactly after the last
micro-batch the trainer received, or at the one that failed. Work is per micro-batch, not per sample, on one background
thread while the trainer computes; the fill spreads its copies, decodes and reads over the
shared pool. Stitching (Python, holding the GIL) and filling are not overlapped with each
other: a fill thread waiting for the GIL behind a stitching thread loses more (every one of its
many short handovers costs a switch interval) than the overlap would win on the memory
bandwidth the fill is bound by.

A failure anywhere travels as a value (:class:`_Failed`) through the stages that follow and
is raised on the trainer's thread: the original exception class, its message first and on one
line (naming the sample, field and position), the worker's traceback as its cause. A
``SystemExit`` or ``KeyboardInterrupt`` in a sample cannot stop a worker thread that the
pipeline then waits on forever.

A batch being prepared answers to its thread's :class:`~r3data.payload.reader.PlanStop`
(:class:`ThreadStops`): a reset, the loader closed (:class:`BatchLoader`) or collected, or the
interpreter exiting sets it, so its reads stop at their next call to the filesystem, its thread
prepares no other batch, and no pool lane keeps retrying for an abandoned batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchdata.nodes import BaseNode, Mapper, ParallelMapper, Prefetcher
from torchdata.nodes.loader import LoaderIterator

from r3data.batch import TensorBatch
from r3data.buffers import BufferPool
from r3data.errors import ConfigError, PayloadReadError
from r3data.nodes.batch_loader import BatchLoader
from r3data.nodes.collate import CollateRollouts
from r3data.nodes.options import CollateOptions, TraceOptions
from r3data.nodes.sample import field_forms
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.source import MicroBatch, StepSource
from r3data.nodes.steps import FAILED, DataParallel, MicroBatches, Shuffle, agree_on_plan
from r3data.nodes.stitcher import StitchRollout
from r3data.nodes.stops import ThreadStops
from r3data.options import as_options, checked_keywords
from r3data.parallel import pool_workers
from r3data.payload.fs import PayloadRoot
from r3data.payload.reader import PayloadReader
from r3data.payload.retention import PayloadRetention
from r3data.validate import checked_int

if TYPE_CHECKING:
    from r3data.layout import TokenLayout

__all__ = ["loader"]


class _Failed:
    """An exception raised while preparing a batch, carried to the trainer's thread."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Stage:
    """One stage of the pipeline, applied to a micro-batch under its thread's stop (never
    started once that is set); a failure travels as a value."""

    def __init__(self, work: Callable[[Any], Any], stops: ThreadStops) -> None:
        self.work = work
        self.stops = stops

    def __call__(self, item: Any) -> Any:
        if isinstance(item, _Failed):
            return item
        try:
            stop = self.stops.of_caller()
            if stop.is_set():
                raise PayloadReadError("batch not prepared: the loader was shut down")
            return stop.run(lambda: self.work(item))
        except BaseException as exc:
            return _Failed(exc)


class _Guarded(BaseNode[Any]):
    """The source, whose failures (a sample that cannot be read, a step that cannot be
    planned) travel down the pipeline as values like every other stage's. A state it refuses
    only once it reads (a stream shorter than the saved step, a nested source refusing its own
    state) is kept as :attr:`refused` and raised by the pipeline's top once every torchdata
    node above has reset whole (one raising halfway through its reset is left unusable)."""

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source
        self.refused: Exception | None = None
        self._refused_state: dict[str, Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.refused = None
        try:
            self.source.reset(initial_state)
        except Exception as exc:
            self.refused, self._refused_state = exc, initial_state

    def next(self) -> Any:
        if self.refused is not None:
            return _Failed(self.refused)
        try:
            return self.source.next()
        except StopIteration:
            raise
        except BaseException as exc:
            return _Failed(exc)

    def get_state(self) -> dict[str, Any] | None:
        return self._refused_state if self.refused is not None else self.source.get_state()


class _InPlace(BaseNode[Any]):
    """The pipeline run on the trainer's thread (``prefetch=0``), with a ``Prefetcher``'s
    state layout, so that a state saved at any prefetch depth resumes a loader at any other."""

    SNAPSHOT, STEPS = "snapshot", "steps_since_snapshot"

    def __init__(self, source: BaseNode[Any], stops: ThreadStops) -> None:
        super().__init__()
        self.source = source
        self.stops = stops
        weakref.finalize(self, stops.close)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.stops.clear()  # a batch another thread is preparing in place is abandoned
        if initial_state is None:
            self.source.reset(None)
            return
        snapshot, steps = _resumed(initial_state)
        self.source.reset(snapshot)
        _fast_forward(self.source, steps)

    def next(self) -> Any:
        return self.source.next()

    def get_state(self) -> dict[str, Any]:
        return {self.SNAPSHOT: self.source.state_dict(), self.STEPS: 0}

    def close(self) -> None:
        """Stop the batch being prepared (on whatever thread runs the loader) for good."""
        self.stops.close()


_ROOT = "state['root']"
"""How an error names the pipeline's state: under ``root`` in the loader's."""
_SOURCE_LAYERS = (_InPlace.SNAPSHOT, ParallelMapper.IT_STATE_KEY, "source")
"""Where the source's state lies in the pipeline's: a ``Prefetcher``'s snapshot, nested by a
``Mapper`` (inline, no workers) and its iterator."""
_YIELDED = LoaderIterator.NUM_YIELDED_KEY
_END = object()


def _path(depth: int) -> str:
    return _ROOT + "".join(f"[{key!r}]" for key in _SOURCE_LAYERS[:depth])


def _resumed(state: Any) -> tuple[dict[str, Any], int]:
    """The snapshot and steps since it of a state in a ``Prefetcher``'s layout, each layer
    down to the source's a dict (a layer edited to ``None`` would start the data over) and the
    steps an int >= 0; the source checks its own keys."""
    layer = state
    for depth in range(len(_SOURCE_LAYERS) + 1):
        if depth:
            layer = layer.get(_SOURCE_LAYERS[depth - 1])
        if not isinstance(layer, Mapping):
            raise ConfigError(f"{_path(depth)}: expected a dict, found {layer!r:.40}")
    steps = checked_int(f"{_ROOT}[{_InPlace.STEPS!r}]", state.get(_InPlace.STEPS))
    return state[_InPlace.SNAPSHOT], steps


def _check_loaded(source: StepSource, state: Any) -> None:
    """A loader's state checked whole before any node resets, so that a refused one leaves
    the loader as it was: torchdata's keys, each layer down to the source's, and the source's
    own keys (only what needs the data read, such as a fast-forward past the end, is left to
    the reset)."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state: expected a dict (a loader's state_dict()), found {state!r:.40}")
    checked_int(f"state[{_YIELDED!r}]", state.get(_YIELDED))
    layer, _ = _resumed(state.get(LoaderIterator.ROOT_KEY))
    for key in _SOURCE_LAYERS[1:]:
        layer = layer[key]
    source.check_state(layer)


def _fast_forward(node: Iterator[Any], steps: int) -> None:
    """Skip the ``steps`` micro-batches a state was saved past its snapshot."""
    for done in range(steps):
        if next(node, _END) is _END:
            raise ConfigError(
                f"{_ROOT}[{_InPlace.STEPS!r}]: expected at most {done} (the micro-batches left "
                f"after the snapshot), found {steps}"
            )


class _StoppingPrefetcher(Prefetcher):
    """torchdata's ``Prefetcher`` whose shutdowns stop the batch its thread is preparing: a
    reset retires the running thread before torchdata joins it (briefly, then leaves it), and
    the node collected (the loader dropped) closes every stop."""

    def __init__(self, source: BaseNode[Any], prefetch_factor: int, stops: ThreadStops) -> None:
        super().__init__(source, prefetch_factor=prefetch_factor)
        self.stops = stops
        weakref.finalize(self, stops.close)  # before torchdata's own shutdown joins the thread

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        resumed = None if initial_state is None else _resumed(initial_state)
        self.stops.retire(getattr(self._it, "_thread", None))  # the run torchdata shuts down
        if resumed is None:
            super().reset(None)
            return
        snapshot, steps = resumed
        super().reset({_InPlace.SNAPSHOT: snapshot, _InPlace.STEPS: 0})
        _fast_forward(self._it, steps)  # torchdata's, but a ConfigError past the end

    def close(self) -> None:
        """Stop the batch being prepared for good, then shut the thread down (torchdata's
        join waits half a second; a stopped batch ends at its next call to the filesystem)."""
        self.stops.close()
        if self._it is not None:
            self._it._shutdown()


class _Delivered(BaseNode[TensorBatch]):
    """The prepared batches, a failure raised on the trainer's thread. After a failure the
    state is the one before the batch that failed, so a loader resumed from it prepares that
    batch again rather than skipping it; the next batch delivered moves it on. A reset raises
    the state the ``guarded`` source refused, once every node below has reset whole."""

    def __init__(self, source: BaseNode[Any], guarded: _Guarded) -> None:
        super().__init__()
        self.source = source
        self.guarded = guarded
        self._before_failure: dict[str, Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._before_failure = None
        self.source.reset(initial_state)
        if self.guarded.refused is not None:  # the state stays loaded: the next pass retries it
            raise self.guarded.refused

    def next(self) -> TensorBatch:
        before = self.source.state_dict()
        batch = self.source.next()
        if isinstance(batch, _Failed):
            self._before_failure = before
            raise batch.error
        self._before_failure = None
        return batch

    def get_state(self) -> dict[str, Any]:
        return self.source.state_dict() if self._before_failure is None else self._before_failure


def _shuffle(value: Shuffle | bool | Mapping[str, Any] | None) -> Shuffle | None:
    if value is None or value is False:
        return None
    return Shuffle() if value is True else as_options(Shuffle, value, "shuffle")


def _screen(screen: ScreenOptions | Mapping[str, Any] | None, num_experts: int | None):
    options = as_options(ScreenOptions, screen, "screen")
    if num_experts is None:
        return options
    checked_int("num_experts", num_experts, minimum=1)
    if options.num_experts not in (None, num_experts):
        raise ConfigError(
            f"num_experts={num_experts}, but screen=ScreenOptions(num_experts="
            f"{options.num_experts}): give it once"
        )
    return dataclasses.replace(options, num_experts=num_experts)


def _reader(
    payload_root: str | os.PathLike[str] | PayloadRoot | None, retention: PayloadRetention | None
) -> PayloadReader | None:
    root = retention.root if payload_root is None and retention is not None else payload_root
    if root is None:
        return None
    # A retention deletes files by the names claimed for them: a file read through a symlink
    # (a second name) would not be kept by its claim, so none is followed.
    follow = retention is None and getattr(root, "follow_symlinks", True)
    if isinstance(root, PayloadRoot):  # its timeout bounds each of the reader's calls
        return PayloadReader(root.path, fs=root.fs, timeout=root.timeout, follow_symlinks=follow)
    return PayloadReader(root, follow_symlinks=follow)


def _check_ranks(
    retention: PayloadRetention | None, ranks: DataParallel, layout: TokenLayout | None
) -> None:
    shared = ranks.size > 1 or (
        layout is not None and layout.tp_size * layout.cp_size * layout.pp_size > 1
    )
    if retention is not None and shared and retention.group is None:
        raise ConfigError(
            "several ranks read this payload root (data-parallel or a parallel layout), but "
            "the retention has no group: give every rank PayloadRetention(..., group=...) so "
            "that one rank deletes once all have read each step"
        )


@contextlib.contextmanager
def _failing_together(group: Any) -> Iterator[None]:
    """A rank of ``group`` whose loader fails before the plan check still joins it, naming
    the failure (the others would wait on it forever): every rank raises the same error."""
    try:
        yield
    except Exception as exc:
        if group is not None:
            agree_on_plan({FAILED: f"{type(exc).__name__}: {exc}"}, group)
        raise


def _agreed(source: StepSource, group: Any) -> None:
    """Check that every rank of ``group`` plans alike; a rank that cannot read its samples
    still joins the collective (the others would wait on it forever), then raises."""
    plan, failure = source.plan_summary(), None
    try:
        plan.update(source.samples_summary())
    except Exception as exc:
        plan["samples"], failure = f"unreadable ({type(exc).__name__}: {exc})", exc
    agree_on_plan(plan, group)
    if failure is not None:
        raise failure


MOVED = {
    "trace_options": "trace=TraceOptions(...), screen=ScreenOptions(...) and num_experts=",
    "fields": "collate=CollateOptions(fields=...)",
    "workers": "collate=CollateOptions(workers=...)",
    "pin_memory": "collate=CollateOptions(pin_memory=...)",
    "buffer_pool": "collate=CollateOptions(buffer_pool=...)",
    "placeholder": "trace=TraceOptions(placeholder=...)",
    "on_gap": "trace=TraceOptions(on_gap=...)",
    "topk": "trace=TraceOptions(topk=...)",
    "payload_fs": "payload_root=PayloadRoot(path, fs)",
}
"""Where the options of earlier releases went (named in the error a former one gets)."""


@checked_keywords(MOVED)
def loader(
    samples: Sequence[Any] | Iterable[Any] | BaseNode[Any],
    *,
    batch_size: int,
    micro_batches: MicroBatches | Mapping[str, Any] | None = None,
    data_parallel: DataParallel | Mapping[str, Any] | None = None,
    shuffle: Shuffle | bool | Mapping[str, Any] | None = None,
    drop_last: bool = False,
    start_step: int = 0,
    num_experts: int | None = None,
    layout: TokenLayout | None = None,
    payload_root: str | os.PathLike[str] | PayloadRoot | None = None,
    retention: PayloadRetention | None = None,
    trace: TraceOptions | Mapping[str, Any] | None = None,
    screen: ScreenOptions | Mapping[str, Any] | None = None,
    collate: CollateOptions | Mapping[str, Any] | None = None,
    prefetch: int = 2,
) -> BatchLoader:
    """A resumable loader of this rank's micro-batches (:class:`TensorBatch`, see
    :mod:`r3data.nodes.collate`), optimizer step after optimizer step.

    ``samples``: dicts or dataclasses (see :mod:`r3data.nodes.sample`): a list or any
    map-style collection, a re-iterable, a torchdata ``BaseNode`` or a stateful iterable
    (state nested, resumed), the same on every rank. ``batch_size`` samples are one optimizer
    step's global batch over all ``data_parallel`` ranks (``DataParallel(rank=..., size=...)``
    or ``DataParallel.from_torch()``, whose group the loader checks, once, for ranks that plan
    differently); each rank gets a disjoint share balanced by tokens, cut
    into ``micro_batches`` (``MicroBatches(size=...)`` or ``MicroBatches(max_tokens=...)``;
    default: one per step), as many on every rank. ``shuffle`` (``True`` or ``Shuffle(seed=...,
    epoch=...)``) permutes a map-style source; ``drop_last`` drops a short last step; steps count
    from ``start_step``. Every micro-batch records its ``step``, ``micro_batch`` and
    ``micro_batches`` in its metadata.

    ``num_experts`` refuses ids at or above it and stores routes in the narrowest dtype.
    ``layout`` (this rank's ``TokenLayout``) makes reads rank-local: stitched fields are
    :class:`~r3data.layout.RankRows` holding only the rank's rows. ``payload_root`` (path,
    fsspec URL or ``PayloadRoot``; default: the retention's) is where by-handle sources live.
    With ``retention``, every payload file is kept until ``retention.on_policy_update(step)``
    for the last step that reads it (a map-style source's files are claimed up front; a
    stream's as each sample is stitched, before any read). ``trace``, ``screen`` and
    ``collate`` take :class:`~r3data.nodes.options.TraceOptions`,
    :class:`~r3data.nodes.screen.ScreenOptions` and
    :class:`~r3data.nodes.options.CollateOptions` (or mappings of their fields). With
    ``prefetch`` > 0 the next micro-batches are stitched and filled in the background.
    ``close()`` (or a ``with`` block) stops that work at once (:class:`BatchLoader`).

    A misspelt keyword or option is a :class:`~r3data.errors.ConfigError` naming it.
    """
    ranks = as_options(DataParallel, data_parallel, "data_parallel")
    with _failing_together(ranks.group):  # before the plan check: every rank must reach it
        checked_int("batch_size", batch_size, minimum=1)
        checked_int("prefetch", prefetch)
        checked_int("start_step", start_step)
        if batch_size % ranks.size:
            raise ConfigError(
                f"batch_size: expected a multiple of the {ranks.size} data-parallel ranks (each "
                f"takes an equal share of a step), found {batch_size}"
            )
        if not isinstance(drop_last, bool):
            raise ConfigError(f"drop_last: expected a bool, found {drop_last!r}")
        micro = (
            None
            if micro_batches is None
            else as_options(MicroBatches, micro_batches, "micro_batches")
        )
        trace = as_options(TraceOptions, trace, "trace")
        collate = as_options(CollateOptions, collate, "collate")
        screen = _screen(screen, num_experts)
        if retention is not None and not isinstance(retention, PayloadRetention):
            raise ConfigError(
                f"retention: expected a PayloadRetention, found {type(retention).__name__}"
            )
        _check_ranks(retention, ranks, layout)
        if (
            trace.on_gap == "drop_sample"
            and layout is not None
            and not (layout.cp_size == 1 and layout.sp_size == 1)
        ):
            raise ConfigError(
                f"trace.on_gap='drop_sample' with a rank-local {layout}: each rank reads only its "
                "rows of a sample, so the ranks of one micro-batch could drop different samples; "
                "use 'drop_routes' (the default) or 'raise'"
            )
        threads = pool_workers() if collate.workers is None else collate.workers
        source = StepSource(
            samples,
            batch_size=batch_size,
            dp_rank=ranks.rank,
            dp_size=ranks.size,
            micro_batches=micro,
            shuffle=_shuffle(shuffle),
            drop_last=drop_last,
            start_step=start_step,
            retention=retention,
        )
    source.state_name = _path(len(_SOURCE_LAYERS))
    if ranks.group is not None:  # DataParallel.from_torch: a real group to check the plan on
        _agreed(source, ranks.group)
    stitch = StitchRollout(
        collate.fields,
        trace,
        retention=None if source.kind == "map" else retention,  # map-style: claimed up front
    )
    fill = CollateRollouts(
        collate.fields,
        _reader(payload_root, retention),
        collate.pin_memory,
        threads,
        screen=screen,
        on_gap=trace.on_gap,
        routes_field=trace.routes_field,
        layout=layout,
        pool=BufferPool() if collate.buffer_pool is None else collate.buffer_pool,
    )

    def prepared(micro: MicroBatch[tuple[int, Any]]) -> TensorBatch:
        rollouts = micro.with_items([stitch(item, micro.step) for item in micro.items])
        forms = None
        if all(r.stitched is None for r in rollouts.items):  # no sample of its own
            forms = field_forms(micro.step_samples, collate.fields, trace)
        return fill(rollouts, forms)

    stops = ThreadStops()
    guarded = _Guarded(source)
    node = Mapper(guarded, _Stage(prepared, stops))
    work = _StoppingPrefetcher(node, prefetch, stops) if prefetch else _InPlace(node, stops)
    return BatchLoader(
        _Delivered(work, guarded), work, check_state=lambda state: _check_loaded(source, state)
    )
