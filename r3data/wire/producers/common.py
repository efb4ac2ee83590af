"""What every producer decoder shares: reading a response, choices, lengths, zero routes."""

from __future__ import annotations

import logging
import mmap
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from r3data.errors import ConfigError, EngineRoutesError, R3DataError, WireFormatError
from r3data.wire.anchors import nonnegative_int
from r3data.wire.envelope import decode_base64
from r3data.wire.rows import InlineRows
from r3data.wire.splice import load_packed_body

__all__ = [
    "OnZero",
    "check_route_shape",
    "choice_token_lengths",
    "decoded_blob",
    "dense_layers",
    "optional_position",
    "parse_response",
    "screen_routes",
    "screened_rows",
    "select_choices",
]

logger = logging.getLogger("r3data.wire")

#: What to do with a route array that is zero in every layer (a known engine bug):
#: "drop" it (logged), "warn" and keep it, or "raise" :class:`EngineRoutesError`.
OnZero = Literal["drop", "warn", "raise"]

_RAW_BODIES = (bytes, bytearray, memoryview, mmap.mmap)


def parse_response(response: Any, fields: tuple[str, ...]) -> Any:
    """A raw body is parsed with :func:`load_packed_body`; a parsed one is used as is."""
    if isinstance(response, _RAW_BODIES):
        return load_packed_body(response, fields)
    if isinstance(response, Mapping | list):
        return response
    raise WireFormatError(
        f"response: expected a raw JSON body or a parsed object, found {type(response).__name__}"
    )


def select_choices(
    response: Any, choice: int | None, what: str
) -> list[tuple[int, Mapping[str, Any]]]:
    """``[(index, choice), ...]`` from an OpenAI-style ``choices`` list (all, or one)."""
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list):
        raise WireFormatError(f"{what}: expected a response with a 'choices' list")
    if choice is not None and not 0 <= choice < len(choices):
        raise ConfigError(f"{what}: choice {choice} out of range; response has {len(choices)}")
    picked = range(len(choices)) if choice is None else (choice,)
    selected = []
    for index in picked:
        if not isinstance(choices[index], Mapping):
            raise WireFormatError(
                f"{what}: choices[{index}]: expected an object, found "
                f"{type(choices[index]).__name__}"
            )
        selected.append((index, choices[index]))
    return selected


def choice_token_lengths(
    response: Mapping[str, Any], choice: Mapping[str, Any]
) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` from vLLM-style token id lists, where present.

    vLLM puts ``prompt_token_ids`` in each choice (completions) or at the top level (chat)
    and the sampled ids in ``choices[i].token_ids`` when ``return_token_ids`` is set.
    """
    prompt = choice.get("prompt_token_ids")
    if prompt is None:
        prompt = response.get("prompt_token_ids")
    completion = choice.get("token_ids")
    return (
        len(prompt) if isinstance(prompt, list) else None,
        len(completion) if isinstance(completion, list) else None,
    )


def optional_position(value: object, what: str, error: type[R3DataError]) -> int | None:
    """``None`` or a non-negative int; anything else raises ``error``."""
    return None if value is None else nonnegative_int(what, value, error)


def decoded_blob(value: object, what: str) -> bytes | bytearray | memoryview:
    """The bytes of a bare base64 field: decoded here from a parsed ``str``, or as
    :func:`load_packed_body` already decoded them."""
    if isinstance(value, str):
        return decode_base64(value, what=what)
    if isinstance(value, bytes | bytearray | memoryview):
        return value
    if value is None:
        raise WireFormatError(
            f"{what}: no routes (null or absent); was the request sent with routes enabled?"
        )
    raise WireFormatError(f"{what}: expected a base64 string, found {type(value).__name__}")


def check_route_shape(routes: np.ndarray, what: str) -> None:
    if routes.ndim != 3 or routes.shape[1] == 0 or routes.shape[2] == 0:
        raise WireFormatError(
            f"{what}: expected routes [rows, layers > 0, topk > 0], found shape {routes.shape}"
        )


def dense_layers(routes: np.ndarray) -> tuple[int, ...]:
    """Layers whose every entry is 0, as engines report dense (non-MoE) layers.

    A real MoE row holds ``topk`` distinct experts, so with ``topk >= 2`` it is never all
    zero; with top-1 routing a MoE layer whose every token picked expert 0 looks dense too.
    """
    if routes.shape[0] == 0:
        return ()
    candidates = np.flatnonzero(~routes[0].any(axis=-1))
    return tuple(int(layer) for layer in candidates if not routes[:, layer].any())


def screened_rows(
    field: str, routes: np.ndarray, pos: int, on_zero: OnZero, what: str, **meta: Any
) -> list[InlineRows]:
    """``routes`` as one :class:`InlineRows` (with ``meta`` and ``dense_layers``), or none when
    they are zero in every layer and ``on_zero`` drops them."""
    keep, dense = screen_routes(routes, on_zero, what)
    return [InlineRows(field, routes, pos, {**meta, "dense_layers": dense})] if keep else []


def screen_routes(routes: np.ndarray, on_zero: OnZero, what: str) -> tuple[bool, tuple[int, ...]]:
    """``(keep, dense_layers)``; routes zero in every layer are handled as ``on_zero`` says."""
    if on_zero not in ("drop", "warn", "raise"):
        raise ConfigError(f"on_zero: expected 'drop', 'warn' or 'raise', found {on_zero!r}")
    check_route_shape(routes, what)
    dense = dense_layers(routes)
    if routes.shape[0] == 0 or len(dense) < routes.shape[1]:
        return True, dense
    message = (
        f"{what}: all {routes.shape[0]} route rows are zero in all {routes.shape[1]} layers "
        f"(a known engine bug); they must not be replayed"
    )
    if on_zero == "raise":
        raise EngineRoutesError(message)
    if on_zero == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return True, dense
    logger.warning("%s; dropped", message)
    return False, dense
