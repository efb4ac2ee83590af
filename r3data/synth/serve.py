"""Serve synthetic rollouts the way inference servers do: response bodies or payload files.

Each request's rows go out as the raw body one producer would send (vLLM, SGLang, prime-rl,
SkyRL) or as a payload file written by handle; :func:`serve_rollouts` turns whole rollouts into
samples ``r3data.loader`` accepts. Every turn asks only for rows it has not returned before, as
incremental multi-turn clients do.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pybase64

from r3data.errors import ConfigError
from r3data.payload import PayloadWriter
from r3data.synth.rollouts import Rollout
from r3data.trace import ROUTES_FIELD
from r3data.wire import pack_ndarray

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

INLINE_PRODUCERS = ("vllm", "sglang", "prime-rl", "skyrl")


def _npy_base64(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return pybase64.b64encode_as_string(buffer.getbuffer())


def vllm_response(
    rows: np.ndarray, *, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> bytes:
    """A vLLM ``/v1/completions`` body: ``routed_experts`` is base64 of a ``.npy`` file."""
    choice = {
        "index": 0,
        "text": "",
        "token_ids": [int(t) for t in completion_ids],
        "prompt_token_ids": [int(t) for t in prompt_ids],
        "finish_reason": "stop",
        "routed_experts": _npy_base64(rows),
    }
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids)}
    return orjson.dumps({"object": "text_completion", "choices": [choice], "usage": usage})


def sglang_response(rows: np.ndarray, *, start: int, prompt_len: int, completion_len: int) -> bytes:
    """An SGLang ``/generate`` body: ``meta_info.routed_experts`` is base64 of flat int32 ids."""
    flat = np.ascontiguousarray(rows, dtype="<i4").reshape(-1)
    meta_info = {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "routed_experts_start_len": start,
        "routed_experts": pybase64.b64encode_as_string(flat.view(np.uint8)),
    }
    return orjson.dumps({"text": "", "meta_info": meta_info})


def primerl_response(rows: np.ndarray, *, start: int) -> bytes:
    """A prime-rl body: an envelope with ``data`` first and the first position as ``start``."""
    choice = {"index": 0, ROUTES_FIELD: pack_ndarray(rows, start=start)}
    return orjson.dumps({"choices": [choice]})


def skyrl_response(rows: np.ndarray, *, start: int) -> bytes:
    """A SkyRL body: the bare envelope, its first position in the ``start`` sidecar."""
    return orjson.dumps(pack_ndarray(rows, start=start))


def request_source(
    producer: str, rollout: Rollout, request: int, *, zero_routes: bool = False
) -> dict[str, Any]:
    """Request ``request`` of ``rollout`` as a loader source: the producer's raw body plus the
    keyword arguments its decoder needs. ``zero_routes`` sends correctly shaped all-zero rows (a
    known engine bug), which the loader's screen finds missing."""
    start, stop = rollout.route_span(request)
    rows = rollout.routes[start:stop]
    if zero_routes:
        rows = np.zeros_like(rows)
    prompt_len, completion_len = rollout.requests[request]
    if producer == "vllm":
        body = vllm_response(
            rows,
            prompt_ids=rollout.token_ids[:prompt_len],
            completion_ids=rollout.token_ids[prompt_len : prompt_len + completion_len],
        )
        return {"producer": producer, "response": body, "prompt_start": start}
    if producer == "sglang":
        body = sglang_response(
            rows, start=start, prompt_len=prompt_len, completion_len=completion_len
        )
        layers, topk = rows.shape[1:]
        return {
            "producer": producer,
            "response": body,
            "num_layers": layers,
            "topk": topk,
        }
    if producer == "prime-rl":
        return {
            "producer": producer,
            "response": primerl_response(rows, start=start),
        }
    if producer == "skyrl":
        return {
            "producer": producer,
            "response": skyrl_response(rows, start=start),
        }
    raise ConfigError(f"producer must be one of {list(INLINE_PRODUCERS)}, found {producer!r}")


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
                served.inline_route_bytes += rows.nbytes
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
