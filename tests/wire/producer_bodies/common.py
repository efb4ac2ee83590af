"""Helpers shared by the producer body builders and their tests: serialisation, and the
engine's rows the builders start from.

The producers write JSON in one of two ways, and the bytes differ (spacing, key order kept,
non-ASCII left as UTF-8 in both):

- FastAPI/Starlette ``JSONResponse(content=model.model_dump())`` (vLLM's OpenAI and tokens
  servers, prime-rl, NeMo-RL through vLLM): ``json.dumps(content, ensure_ascii=False,
  allow_nan=False, indent=None, separators=(",", ":"))`` (starlette/responses.py,
  ``JSONResponse.render``).
- ``orjson.dumps`` (SkyRL's ``/skyrl/v1/generate``, SGLang's ORJSONResponse): compact too.
- Server-sent events: ``b"data: " + json + b"\\n\\n"``, closed by ``data: [DONE]`` on the
  OpenAI-style streams (vLLM ``serve_tokens_stream_generator``, SGLang ``generate_request``).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import orjson

__all__ = [
    "b64_raw",
    "check_routes",
    "engine_rows",
    "npy_b64",
    "orjson_body",
    "sse",
    "starlette_body",
]


def starlette_body(content: Any) -> bytes:
    """Bytes of ``starlette.responses.JSONResponse(content)``."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def orjson_body(content: Any) -> bytes:
    """Bytes of ``orjson.dumps(content)`` (SkyRL, SGLang)."""
    return orjson.dumps(content)


def sse(events: Iterable[bytes], *, done: bool = True) -> bytes:
    """A server-sent-event stream of JSON ``events``, optionally closed by ``[DONE]``."""
    out = b"".join(b"data: " + event + b"\n\n" for event in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def npy_b64(array: np.ndarray) -> str:
    """Base64 of ``np.save(array, allow_pickle=False)`` (vLLM ``numpy2base64``)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def b64_raw(array: np.ndarray) -> str:
    """Base64 of an array's C-ordered bytes, no header (``pybase64.b64encode(memoryview(a))``
    in prime-rl, SkyRL and NeMo-RL; ``tensor.numpy().tobytes()`` in SGLang)."""
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def check_routes(routes: np.ndarray, what: str = "routes") -> np.ndarray:
    """``routes`` as a ``[rows, layers, topk]`` integer array (the engine's rows)."""
    routes = np.asarray(routes)
    if routes.ndim != 3 or routes.dtype.kind not in "iu":
        raise ValueError(
            f"{what}: expected an integer [rows, layers, topk] array, got {routes.shape}"
        )
    return routes


def engine_rows(
    tokens: int, *, layers: int, topk: int, experts: int = 8, seed: int = 0, lowest_id: int = 0
) -> np.ndarray:
    """Seeded engine rows for positions ``[0, tokens - 1)``, int64 ``[rows, layers, topk]``:
    ``topk`` distinct expert ids in ``[lowest_id, experts)`` per layer, layer 0 dense (zeros)."""
    rng = np.random.default_rng(seed)
    shape = (tokens - 1, layers, experts - lowest_id)
    rows = np.argsort(rng.random(shape), axis=-1)[..., :topk] + lowest_id
    rows[:, 0] = 0
    return rows.astype(np.int64)
