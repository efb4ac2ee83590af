"""``SampleSource``: the first node, yielding ``(index, sample)`` with a resumable position."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from r3data.errors import ConfigError


class SampleSource(BaseNode[tuple[int, Any]]):
    """Samples of a map-style collection (resumed by index) or a re-iterable (fast-forwarded).

    A one-shot iterator (a generator) cannot be resumed: loading a state into one raises.
    """

    NEXT_INDEX_KEY = "next_index"

    def __init__(self, samples: Sequence[Any] | Iterable[Any]) -> None:
        super().__init__()
        self.samples = samples
        self._map_style = hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
        self._next_index = 0
        self._it: Iterator[Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._next_index = initial_state[self.NEXT_INDEX_KEY] if initial_state else 0
        if self._map_style:
            return
        self._it = iter(self.samples)
        if self._next_index and self._it is self.samples:
            raise ConfigError(
                f"cannot resume at sample {self._next_index}: the samples are a one-shot "
                f"iterator ({type(self.samples).__name__}); pass a list or a re-iterable"
            )
        for skipped in range(self._next_index):
            if next(self._it, _END) is _END:
                raise ConfigError(
                    f"cannot resume at sample {self._next_index}: the samples end after {skipped}"
                )

    def next(self) -> tuple[int, Any]:
        index = self._next_index
        if self._map_style:
            if index >= len(self.samples):  # type: ignore[arg-type]
                raise StopIteration
            sample = self.samples[index]  # type: ignore[index]
        else:
            sample = next(self._it)  # type: ignore[arg-type]
        self._next_index = index + 1
        return index, sample

    def get_state(self) -> dict[str, Any]:
        return {self.NEXT_INDEX_KEY: self._next_index}


_END = object()
