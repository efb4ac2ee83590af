"""``StepSource``: the first node, yielding this rank's micro-batches of every optimizer step.

The source of samples is the whole data, the same on every data-parallel rank: a map-style
collection (``len`` and indexing; resumed by index, optionally shuffled), a torchdata
``BaseNode`` or an iterable with ``state_dict``/``load_state_dict`` (a stateful sampler or
loader; their state is nested in this node's), any other re-iterable (fast-forwarded), or a
one-shot iterator (which cannot resume). Each step reads the next ``batch_size`` samples, the
global batch, and plans every rank's share (:func:`~r3data.nodes.steps.plan_step`) from
their lengths; only this rank's samples go on down the pipeline.

State: the step and micro-batch to yield next, the nested source's state at the start of
that step, so a resumed rank reads exactly the micro-batches it has not yielded, and whether
the data ended (a short step was the last: a stream is not fast-forwarded past its end, nor a
stateful one started over). A state loaded is checked key by key: an edited one is a
``ConfigError`` naming the key, never samples repeated or skipped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from torch.utils.data import IterableDataset
from torchdata.nodes import BaseNode

from r3data.errors import ConfigError, TraceError, with_message
from r3data.nodes.sample import name_sample, sample_files, sample_id_of, sample_length
from r3data.nodes.steps import MicroBatches, Shuffle, plan_step
from r3data.payload.retention import PayloadRetention
from r3data.validate import checked_int

__all__ = ["MicroBatch", "StepSource"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class MicroBatch(Generic[T]):
    """One micro-batch of optimizer ``step`` on this rank: number ``index`` of ``count`` (the
    same count on every data-parallel rank), ``items`` in global sample order.
    ``step_samples``: every rank's ``(index, raw sample)`` of the step, from which a
    micro-batch without a sample of its own takes the form of its fields."""

    step: int
    index: int
    count: int
    items: list[T]
    step_samples: Sequence[tuple[int, Any]] = ()

    def with_items(self, items: list[U]) -> MicroBatch[U]:
        return replace(self, items=items)  # type: ignore[return-value]


def _kind(samples: Any) -> str:
    if isinstance(samples, BaseNode):
        return "node"
    # torch's Dataset gives every IterableDataset a __getitem__ that raises: a stream
    indexable = not isinstance(samples, IterableDataset) and hasattr(samples, "__getitem__")
    if indexable and hasattr(samples, "__len__"):
        return "map"
    if hasattr(samples, "state_dict") and hasattr(samples, "load_state_dict"):
        return "stateful"
    if iter(samples) is samples:
        return "iterator"
    return "iterable"


class StepSource(BaseNode[MicroBatch[tuple[int, Any]]]):
    """Yields this rank's :class:`MicroBatch`es of ``(sample index, raw sample)``.

    ``batch_size`` samples per optimizer step over all ``dp_size`` ranks; steps are numbered
    from ``start_step``. A short last step is dropped with ``drop_last``. With a
    ``retention`` and a map-style source, every payload file a sample names is claimed up
    front for the last step that reads it (every rank's samples: all references are known),
    so a file shared by samples of different steps outlives the updates in between.
    """

    STEP_KEY, MICRO_KEY, SOURCE_KEY, PLAN_KEY = "step", "micro_batch", "source", "plan"
    ENDED_KEY = "ended"
    """True once a step came out short: the data ended (a stream is not read again)."""
    STEP_PLAN = ("batch_size", "start_step", "shuffle")
    """What a saved step means: the samples it starts at and its number."""
    MICRO_PLAN = ("dp_size", "micro_batches")
    """What a saved micro-batch inside a step means too: free to change between steps."""
    state_name = "state"
    """How an error names this node's state (a pipeline names its place in its own)."""

    def __init__(
        self,
        samples: Sequence[Any] | Iterable[Any] | BaseNode[Any],
        *,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        micro_batches: MicroBatches | None = None,
        shuffle: Shuffle | None = None,
        drop_last: bool = False,
        start_step: int = 0,
        retention: PayloadRetention | None = None,
    ) -> None:
        super().__init__()
        self.samples = samples
        self.kind = _kind(samples)
        if shuffle is not None and self.kind != "map":
            raise ConfigError(
                f"shuffle needs a map-style source (len and indexing), found "
                f"{type(samples).__name__}: shuffle it upstream"
            )
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.micro_batches, self.shuffle = micro_batches, shuffle
        self.drop_last, self.start_step, self.retention = drop_last, start_step, retention
        self._order: Sequence[int] | None = None
        self._it: Iterator[Any] | None = None
        self._step = 0  # steps read so far: the next one to plan
        self._micro = 0  # micro-batches of the current step yielded
        self._plan: list[list[tuple[int, Any]]] | None = None
        self._batch: list[tuple[int, Any]] = []  # the global batch of the step being yielded
        self._ended = False  # a step came out short: nothing follows it
        self._source_state: Any = None  # the nested source's state at the start of _step
        self._plan_state: Any = None  # ... and at the start of the step being yielded

    # --- state ----------------------------------------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        state = self.check_state(initial_state)
        self._step = state.get(self.STEP_KEY, 0)
        self._micro = state.get(self.MICRO_KEY, 0)
        self._plan = None
        self._source_state = state.get(self.SOURCE_KEY)
        # a stream past its end is not read again (a map-style source is indexed by step)
        self._ended = self.kind != "map" and state.get(self.ENDED_KEY, False)
        if not self._ended:
            self._open()
        if self.kind == "map" and self.retention is not None and self.retention.deletes:
            self._claim_every_file()

    def check_state(self, initial_state: Any) -> dict[str, Any]:
        """``initial_state`` with every key this node reads checked, nothing read or changed (an
        edited or foreign state would otherwise repeat, skip or wrap samples silently, or fail
        untyped). A step inside a map-style source, or at its end, resumes; one past the end
        does not (a stream's fast-forward refuses it too, when it reads). The micro-batch is
        checked once its step is planned."""
        if initial_state is None:
            return {}
        if not isinstance(initial_state, Mapping):
            raise ConfigError(f"{self.state_name}: expected a dict, found {initial_state!r:.40}")
        state = dict(initial_state)
        for key in (self.STEP_KEY, self.MICRO_KEY):
            if key in state:
                state[key] = checked_int(self._key(key), state[key])
        ended = state.get(self.ENDED_KEY, False)
        if type(ended) is not bool:
            raise ConfigError(f"{self._key(self.ENDED_KEY)}: expected a bool, found {ended!r:.40}")
        if self.PLAN_KEY in state and not isinstance(state[self.PLAN_KEY], Mapping):
            raise ConfigError(
                f"{self._key(self.PLAN_KEY)}: expected a dict of the options the state was saved "
                f"under, found {state[self.PLAN_KEY]!r:.40}"
            )
        nested = state.get(self.SOURCE_KEY)
        if self.kind == "node" and not (nested is None or isinstance(nested, Mapping)):
            raise ConfigError(
                f"{self._key(self.SOURCE_KEY)}: expected the torchdata node's state (a dict) or "
                f"None, found {nested!r:.40}"
            )
        if self.kind not in ("node", "stateful") and nested is not None:
            raise ConfigError(
                f"{self._key(self.SOURCE_KEY)}: expected None (samples of kind {self.kind!r} "
                f"keep no state of their own: the step positions them), found {nested!r:.40}; "
                "was the state saved over another source?"
            )
        step = state.get(self.STEP_KEY, 0)
        if step and self.kind == "iterator":
            raise ConfigError(
                f"cannot resume at step {self.start_step + step}: the samples are a one-shot "
                f"iterator ({type(self.samples).__name__}); pass a list, a re-iterable, a "
                "torchdata BaseNode or a stateful iterable"
            )
        if self.PLAN_KEY in state:
            self._check_plan(state[self.PLAN_KEY], state.get(self.MICRO_KEY, 0))
        if self.kind == "map":
            count = len(self.samples)  # type: ignore[arg-type]
            steps = -(-count // self.batch_size)
            if step > steps:
                raise ConfigError(
                    f"{self._key(self.STEP_KEY)}: expected at most {steps} (the end of {count} "
                    f"samples in steps of {self.batch_size}), found {state[self.STEP_KEY]}"
                )
        return state

    def _key(self, name: str) -> str:
        return f"{self.state_name}[{name!r}]"

    def get_state(self) -> dict[str, Any]:
        if self._plan is not None:  # part of a step yielded: resume inside it
            return {
                self.STEP_KEY: self._step - 1,
                self.MICRO_KEY: self._micro,
                self.SOURCE_KEY: self._plan_state,
                self.PLAN_KEY: self._plan_options(),
            }
        return {
            self.STEP_KEY: self._step,
            self.MICRO_KEY: 0,
            self.SOURCE_KEY: self._source_state,
            self.PLAN_KEY: self._plan_options(),
            self.ENDED_KEY: self._ended,
        }

    def _plan_options(self) -> dict[str, Any]:
        shuffle, micro = self.shuffle, self.micro_batches
        return {
            "batch_size": self.batch_size,
            "start_step": self.start_step,
            "shuffle": None if shuffle is None else [shuffle.seed, shuffle.epoch],
            "dp_size": self.dp_size,
            "micro_batches": None if micro is None else [micro.size, micro.max_tokens],
        }

    def plan_summary(self) -> dict[str, Any]:
        """The options every data-parallel rank must agree on (nothing is read)."""
        return {**self._plan_options(), "drop_last": self.drop_last}

    def samples_summary(self) -> dict[str, Any]:
        """What every data-parallel rank's samples must agree on: a map-style source's length
        and the tokens of its first step (which differ when each rank was given its own
        shard); a stream's kind (it cannot be read twice)."""
        if self.kind != "map":
            return {"samples": self.kind}
        count = len(self.samples)  # type: ignore[arg-type]
        first = range(min(count, self.batch_size))
        if self.shuffle is not None:
            first = self.shuffle.order(count)[: self.batch_size].tolist()
        tokens = sum(sample_length(self.samples[i]) for i in first)  # type: ignore[index]
        return {"samples": count, "first_step_tokens": tokens}

    def _check_plan(self, saved: Mapping[str, Any], micro: int) -> None:
        """A saved step resumes only the same steps, a saved micro-batch (``micro`` > 0) the
        same shares: under other options it would skip or repeat samples."""
        now = self._plan_options()
        names = self.STEP_PLAN + (self.MICRO_PLAN if micro else ())
        for name in names:
            if name in saved and saved[name] != now[name]:
                raise ConfigError(
                    f"cannot resume: the state was saved with {name}={saved[name]!r}, found "
                    f"{name}={now[name]!r}; expected the same {', '.join(self.STEP_PLAN)} (and "
                    f"inside a step the same {' and '.join(self.MICRO_PLAN)})"
                )

    def _open(self) -> None:
        """Position the source at the start of step ``self._step``."""
        if self.kind == "map":
            count = len(self.samples)  # type: ignore[arg-type]
            self._order = None if self.shuffle is None else self.shuffle.order(count).tolist()
            return
        if self.kind == "node":
            self.samples.reset(self._source_state)  # type: ignore[union-attr]
            self._it = self.samples  # type: ignore[assignment]
            return
        if self.kind == "stateful":
            if self._source_state is not None:
                self.samples.load_state_dict(self._source_state)  # type: ignore[union-attr]
            self._it = iter(self.samples)
            return
        skip = self._step * self.batch_size
        self._it = iter(self.samples)
        for skipped in range(skip):
            if next(self._it, _END) is _END:
                raise ConfigError(
                    f"cannot resume at step {self.start_step + self._step}: the samples end "
                    f"after {skipped}, before that step's first sample {skip}"
                )

    def _capture(self) -> None:
        """Keep the nested source's state at the start of the next step (only a BaseNode or a
        stateful iterable has one: others are positioned by index or by skipping)."""
        self._plan_state = self._source_state
        if self.kind in ("node", "stateful"):
            self._source_state = self.samples.state_dict()  # type: ignore[union-attr]

    # --- reading --------------------------------------------------------------------------

    def _indices(self, step: int) -> range | list[int]:
        count = len(self.samples)  # type: ignore[arg-type]
        lo, hi = step * self.batch_size, min(count, (step + 1) * self.batch_size)
        if lo >= hi or (self.drop_last and hi - lo < self.batch_size):
            return range(0)
        return range(lo, hi) if self._order is None else self._order[lo:hi]

    def _global_batch(self) -> list[tuple[int, Any]]:
        """The samples of step ``self._step`` with their indices (empty: the data ended)."""
        if self.kind == "map":
            return [(i, self.samples[i]) for i in self._indices(self._step)]  # type: ignore[index]
        first = self._step * self.batch_size
        batch = []
        for offset in range(self.batch_size):
            sample = next(self._it, _END)  # type: ignore[arg-type]
            if sample is _END:
                break
            batch.append((first + offset, sample))
        if self.drop_last and len(batch) < self.batch_size:
            return []
        return batch

    def next(self) -> MicroBatch[tuple[int, Any]]:
        while self._plan is None:
            batch = [] if self._ended else self._global_batch()
            step = self.start_step + self._step
            if not batch:
                if self._micro:  # resumed inside a step the data does not have
                    raise ConfigError(
                        f"{self._key(self.MICRO_KEY)}: expected 0 at the end of the data (step "
                        f"{step} has no samples), found {self._micro}"
                    )
                raise StopIteration
            self._ended = len(batch) < self.batch_size
            lengths = [sample_length(raw) for _, raw in batch]
            shares = plan_step(lengths, self.dp_size, self.micro_batches)
            plan = [[batch[p] for p in micro] for micro in shares[self.dp_rank]]
            if self._micro > len(plan):  # equal: resumed after the step's last micro-batch
                raise ConfigError(
                    f"{self._key(self.MICRO_KEY)}: expected at most {len(plan)} (the micro-batches "
                    f"of step {step} on this rank), found {self._micro}"
                )
            self._plan = plan
            self._batch = batch
            self._step += 1
            self._capture()
            if self._micro >= len(self._plan):  # resumed after this step's last micro-batch
                self._plan, self._micro = None, 0
        micro = MicroBatch(
            self.start_step + self._step - 1,
            self._micro,
            len(self._plan),
            self._plan[self._micro],
            self._batch,
        )
        self._micro += 1
        if self._micro == len(self._plan):
            self._plan, self._micro = None, 0
        return micro

    # --- retention ------------------------------------------------------------------------

    def _claim_every_file(self) -> None:
        """Claim each file named from the current step on for the last step that names it."""
        last: dict[str, int] = {}
        step = self._step
        while indices := self._indices(step):
            for i in indices:
                sample = self.samples[i]  # type: ignore[index]
                try:
                    names = sample_files(sample)
                except TraceError as exc:
                    message = name_sample(str(exc), sample_id_of(sample, i), i)
                    raise with_message(exc, message) from exc
                for name in names:
                    last[name] = self.start_step + step
            step += 1
        by_step: dict[int, list[str]] = defaultdict(list)
        for name, at in last.items():
            by_step[at].append(name)
        for at, names in sorted(by_step.items()):
            self.retention.claim(at, names)  # type: ignore[union-attr]


_END = object()
