"""What one request is to a producer format: the token counts the caller knows
(:class:`Lengths`) and what an engine computed for it (:class:`EngineRequest`, which a format
serves as its producer would)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from r3data.errors import ConfigError
from r3data.ragged import RaggedRows
from r3data.validate import checked_int, request_length

__all__ = ["NO_LENGTHS", "EngineRequest", "Lengths"]


class _Counts(NamedTuple):
    prompt_len: int | None = None
    completion_len: int | None = None


class Lengths(_Counts):
    """The request's token counts as the caller knows them (None: unknown), each an int in
    ``[0, INT64_MAX]`` (a bool, a negative or a float is the request's own error, a
    :class:`TraceError` naming it, as the trace builder's; never a response that disagrees)."""

    __slots__ = ()

    def __new__(cls, prompt_len: int | None = None, completion_len: int | None = None) -> Lengths:
        return super().__new__(
            cls, _length("prompt_len", prompt_len), _length("completion_len", completion_len)
        )


def _length(name: str, value: object) -> int | None:
    return None if value is None else request_length(name, value)


NO_LENGTHS = Lengths()
"""The request's lengths when the caller knows neither."""


@dataclass(frozen=True, eq=False)
class EngineRequest:
    """What an engine computed for one request, for a format to serve as its producer would.

    ``routes`` are the rows the request returns: positions ``[start, prompt + completion - 1)``
    (``start`` the request's prompt start; a format whose engine has none is given ``start``
    0). ``num_experts`` picks the dtype where the producer picks it by the model (default: by
    the ids present). ``moe_layers`` are the layers with a router (a format that sends only
    those keeps these; default: every layer). ``sampling_mask``: per completion token the ids
    the sampler kept (a row of length 0: no mask there, the full vocabulary).
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    routes: np.ndarray
    start: int = 0
    num_experts: int | None = None
    moe_layers: tuple[int, ...] | None = None
    sampling_mask: RaggedRows | None = None

    def __post_init__(self) -> None:
        start = checked_int("EngineRequest.start", self.start, maximum=self.prompt_len)
        object.__setattr__(self, "start", start)
        routes = np.asarray(self.routes)
        if routes.ndim != 3 or routes.dtype.kind not in "iu":
            raise ConfigError(
                f"EngineRequest.routes: expected integer [rows, layers, topk], found shape "
                f"{routes.shape} of {routes.dtype}"
            )
        expected = self.prompt_len + self.completion_len - 1 - self.start
        if routes.shape[0] != expected:
            raise ConfigError(
                f"EngineRequest: expected {expected} route rows (prompt {self.prompt_len} + "
                f"completion {self.completion_len} - 1 - start {self.start}), found "
                f"{routes.shape[0]}"
            )
        if self.sampling_mask is not None and self.sampling_mask.rows != self.completion_len:
            raise ConfigError(
                f"EngineRequest.sampling_mask: expected one row per completion token "
                f"({self.completion_len}), found {self.sampling_mask.rows}"
            )
        object.__setattr__(self, "routes", routes)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_len(self) -> int:
        return len(self.completion_ids)
