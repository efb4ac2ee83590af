"""Serve synthetic rollouts the way inference servers do: response bodies or payload files.

Each request's rows go out as the raw body one producer format would send (any format of the
registry, :data:`r3data.wire.producers.FORMATS`, through its ``encode``) or as a payload file
written by handle; :func:`serve_rollouts` turns whole rollouts into samples ``r3data.loader``
accepts. Every turn asks only for rows it has not returned before, as incremental
multi-turn clients do (a format whose engine has no prompt start sends every row).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3data.errors import ConfigError
from r3data.payload import PayloadWriter
from r3data.synth.rollouts import Rollout
from r3data.trace import ROUTES_FIELD
from r3data.wire.producers import FORMATS, EngineRequest, producer_format

__all__ = [
    "INLINE_PRODUCERS",
    "ServedRollouts",
    "primerl_response",
    "request_source",
    "serve_rollouts",
    "sglang_response",
    "skyrl_response",
    "vllm_response",
]

INLINE_PRODUCERS = tuple(
    name
    for name, entry in FORMATS.items()
    if entry.current
    and entry.prompt_start
    and entry.layer_axis == "all"
    and ROUTES_FIELD in entry.fields
)
"""The producers' current formats that serve incremental turns with every layer's rows."""


def _request(rows: np.ndarray, prompt_ids: Sequence[int], completion_ids: Sequence[int]):
    """The request whose engine returned ``rows``, the last rows of its forwarded tokens."""
    start = len(prompt_ids) + len(completion_ids) - 1 - rows.shape[0]
    return EngineRequest(prompt_ids, completion_ids, rows, start=start)


def _ids(length: int) -> list[int]:
    return list(range(length))


def vllm_response(
    rows: np.ndarray, *, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> bytes:
    """A vLLM ``/v1/completions`` body: ``routed_experts`` is base64 of a ``.npy`` file."""
    return FORMATS["vllm"].encode(_request(rows, prompt_ids, completion_ids))


def sglang_response(rows: np.ndarray, *, start: int, prompt_len: int, completion_len: int) -> bytes:
    """An SGLang ``/generate`` body: ``meta_info.routed_experts`` is base64 of flat int32 ids
    (rows from ``start``, the request's ``routed_experts_start_len``, which SGLang does not
    echo)."""
    request = EngineRequest(_ids(prompt_len), _ids(completion_len), rows, start=start)
    return FORMATS["sglang"].encode(request)


def _lengths(rows: np.ndarray, start: int, prompt_len: int | None, completion_len: int | None):
    """Token ids for a request of these lengths (default: the prompt up to ``start`` and one
    completion token per row after it)."""
    prompt = start + 1 if prompt_len is None else prompt_len
    completion = start + rows.shape[0] + 1 - prompt if completion_len is None else completion_len
    return _ids(prompt), _ids(completion)


def primerl_response(
    rows: np.ndarray,
    *,
    start: int,
    prompt_len: int | None = None,
    completion_len: int | None = None,
) -> bytes:
    """A prime-rl body: an envelope with ``data`` first and the first position as ``start``."""
    prompt, completion = _lengths(rows, start, prompt_len, completion_len)
    return FORMATS["prime-rl"].encode(EngineRequest(prompt, completion, rows, start=start))


def skyrl_response(
    rows: np.ndarray,
    *,
    start: int,
    prompt_len: int | None = None,
    completion_len: int | None = None,
) -> bytes:
    """A SkyRL body: the envelope in ``choices[0]``; its rows start at ``start``, the request's
    prompt start, which SkyRL does not send."""
    prompt, completion = _lengths(rows, start, prompt_len, completion_len)
    return FORMATS["skyrl"].encode(EngineRequest(prompt, completion, rows, start=start))


def request_source(
    producer: str, rollout: Rollout, request: int, *, zero_routes: bool = False
) -> dict[str, Any]:
    """Request ``request`` of ``rollout`` as a loader source: the body ``producer`` (a format
    name) would send, plus the options its client knows (start, model shape).
    ``zero_routes`` sends correctly shaped all-zero rows (a known engine bug), which the
    loader's screen finds missing."""
    entry = producer_format(producer)
    if ROUTES_FIELD not in entry.fields:
        raise ConfigError(f"producer {producer!r} sends no routes to serve a rollout with")
    start, stop = rollout.route_span(request)
    if not entry.prompt_start:
        start = 0
    rows = rollout.routes[start:stop]
    if zero_routes:
        rows = np.zeros_like(rows)
    prompt_len, completion_len = rollout.requests[request]
    served = EngineRequest(
        rollout.token_ids[:prompt_len],
        rollout.token_ids[prompt_len : prompt_len + completion_len],
        rows,
        start=start,
    )
    options = entry.request_options(served)
    return {"producer": producer, "response": entry.encode(served), **options}


@dataclass
class ServedRollouts:
    """Loader samples, and what serving them cost on the wire and on disk."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    inline_rollouts: int = 0
    handle_rollouts: int = 0
    inline_route_bytes: int = 0
    """Route bytes sent inline, decoded."""
    inline_body_bytes: int = 0
    """Bytes of the response bodies that carried them (base64 and JSON included)."""
    handle_route_bytes: int = 0
    files: list[str] = field(default_factory=list)
    zero_route_rollouts: list[str] = field(default_factory=list)


def serve_rollouts(
    rollouts: Sequence[Rollout],
    *,
    producers: Sequence[str] = ("vllm", "prime-rl"),
    writer: PayloadWriter | None = None,
    version: int = 0,
    zero_routes: Collection[int] = (),
    progress: Callable[[Iterable[Any]], Iterable[Any]] = iter,
) -> ServedRollouts:
    """Samples for ``r3data.loader``: with a ``writer``, odd rollouts travel by handle (one
    payload file per request, policy ``version``), the rest inline, cycling through
    ``producers``. Inline rollouts whose index is in ``zero_routes`` get all-zero routes in
    their last request."""
    if not producers:
        raise ConfigError("producers must name at least one inline producer, found none")
    served = ServedRollouts()
    for i in progress(range(len(rollouts))):
        rollout = rollouts[i]
        by_handle = writer is not None and i % 2 == 1
        requests = []
        for j, (prompt_len, completion_len) in enumerate(rollout.requests):
            start, stop = rollout.route_span(j)
            rows = rollout.routes[start:stop]
            if by_handle:
                segment = writer.write(version, {ROUTES_FIELD: rows}, pos=start)[0]
                source: dict[str, Any] = segment.to_dict()
                served.files.append(segment.file)
                served.handle_route_bytes += rows.nbytes
            else:
                producer = producers[served.inline_rollouts % len(producers)]
                zero = i in zero_routes and j == len(rollout.requests) - 1
                source = request_source(producer, rollout, j, zero_routes=zero)
                sent = start if producer_format(producer).prompt_start else 0  # else every row
                served.inline_route_bytes += rollout.routes[sent:stop].nbytes
                served.inline_body_bytes += len(source["response"])
                if zero:
                    served.zero_route_rollouts.append(rollout.rollout_id)
            requests.append(
                {"prompt_len": prompt_len, "completion_len": completion_len, "sources": [source]}
            )
        served.handle_rollouts += by_handle
        served.inline_rollouts += not by_handle
        served.samples.append(
            {
                "id": rollout.rollout_id,
                "token_ids": rollout.token_ids,
                "loss_mask": rollout.loss_mask,
                "logprobs": rollout.logprobs,
                "requests": requests,
            }
        )
    return served
