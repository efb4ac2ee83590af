"""``BatchLoader``: what :func:`~r3data.loader` returns, a torchdata ``Loader`` that closes.

A loader left to the garbage collector stops its work only when it is collected (its nodes
reference each other: a collection, not the last reference, frees them). :meth:`close` stops
it now: the batch being prepared (its reads stop at their next call to the filesystem) and the
prefetch thread. The state saved up to the close still resumes a new loader.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

from torchdata.nodes import BaseNode, Loader

from r3data.batch import TensorBatch
from r3data.errors import UsageError

__all__ = ["BatchLoader"]


class _Closable(Protocol):
    """The part of the pipeline whose work a close stops (its thread, its batch in flight)."""

    def close(self) -> None: ...


class _UntilClosed(BaseNode[TensorBatch]):
    """The loader's root: the pipeline's batches until closed, then a :class:`UsageError` for
    a batch or a new pass (the trainer may still hold an iterator)."""

    def __init__(self, pipeline: BaseNode[TensorBatch]) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.closed = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        self._check_open()
        super().reset(initial_state)
        self.pipeline.reset(initial_state)

    def next(self) -> TensorBatch:
        self._check_open()
        return self.pipeline.next()

    def get_state(self) -> dict[str, Any]:
        return self.pipeline.state_dict()

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError(
                "loader: expected an open loader to iterate, found it closed; a new loader "
                "resumes from its state_dict()"
            )


class BatchLoader(Loader[TensorBatch]):
    """A torchdata ``Loader`` of micro-batches whose work :meth:`close` (or the end of a
    ``with`` block) stops at once; ``state_dict()`` keeps working after it."""

    def __init__(
        self,
        pipeline: BaseNode[TensorBatch],
        work: _Closable,
        check_state: Callable[[Any], None],
    ) -> None:
        self._gate = _UntilClosed(pipeline)
        super().__init__(self._gate, restart_on_stop_iteration=False)
        self._work = work
        self._check_state = check_state

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the loader then yields nothing more)."""
        return self._gate.closed

    def close(self) -> None:
        """Stop the batch being prepared and the prefetch thread (waiting briefly for it;
        a call to the filesystem under way ends within its timeout). Iterating afterwards
        raises :class:`~r3data.errors.UsageError`; closing again does nothing."""
        if self._gate.closed:
            return
        self._gate.closed = True
        self._work.close()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` (a ``state_dict()`` of a loader over the same data) at the
        next pass. It is checked whole now: an edited or foreign one is a
        :class:`~r3data.errors.ConfigError` naming the key, and the loader is left as it was."""
        self._check_state(state_dict)
        super().load_state_dict(copy.deepcopy(state_dict))

    def state_dict(self) -> dict[str, Any]:
        """The state after the last micro-batch delivered (see ``torchdata``'s ``Loader``), or
        the one loaded while no pass has started from it (one refused when the pass started
        stays loaded: every pass raises its refusal until another state is loaded)."""
        if self._next_iter_state_dict is not None:
            return copy.deepcopy(self._next_iter_state_dict)  # the caller's to edit
        if self._it is None and self._gate.closed:
            raise UsageError(
                "state_dict: expected a loader that started a pass, found one closed before "
                "its first; a new loader without a state starts at the beginning"
            )
        return super().state_dict()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
