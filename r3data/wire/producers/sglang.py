"""SGLang: routed experts as base64 of a flat int32 array in ``meta_info``.

What SGLang's ``/generate`` returns with ``--enable-return-routed-experts`` and
``"return_routed_experts": true`` in the request:

- ``meta_info.routed_experts``: base64 of the flat little-endian int32 ids, to be reshaped
  ``(-1, num_layers, topk)``; layers and topk come from the model config, not the response.
- ``routed_experts_start_len`` (a request field; echoed in ``meta_info`` by some servers):
  the response covers positions ``[routed_experts_start_len, seqlen - 1)``, 0 meaning the
  whole sequence.
- ``meta_info.prompt_tokens`` / ``completion_tokens`` give the lengths to check against.
- A batched request returns a list of such objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from r3data.errors import ConfigError, WireFormatError
from r3data.wire.anchors import anchored_pos
from r3data.wire.producers.common import (
    OnZero,
    decoded_blob,
    optional_position,
    parse_response,
    screened_rows,
)
from r3data.wire.rows import InlineRows

__all__ = ["sglang_routes"]

_INT32 = np.dtype("<i4")


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ConfigError(f"sglang_routes: expected {name} to be an int > 0, found {value!r}")
    return int(value)


def sglang_routes(
    response: Any,
    *,
    num_layers: int,
    topk: int,
    start: int | None = None,
    on_zero: OnZero = "raise",
    field: str = "routed_experts",
) -> list[InlineRows]:
    """Routes of an SGLang ``/generate`` response (one object or a batch list), one per item.

    ``num_layers`` and ``topk`` shape the flat ids; the int32 count must divide exactly.
    ``start`` overrides ``meta_info.routed_experts_start_len`` (default 0). ``meta`` holds
    ``producer``, ``choice`` (the item's index in a batch list), ``prompt_len``,
    ``completion_len`` and ``dense_layers``.
    """
    layers, k = _positive(num_layers, "num_layers"), _positive(topk, "topk")
    start_arg = optional_position(start, "start", ConfigError)
    parsed = parse_response(response, (field,))
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for index, item in enumerate(items):
        what = f"sglang [{index}].meta_info.{field}"
        meta_info = item.get("meta_info") if isinstance(item, Mapping) else None
        if not isinstance(meta_info, Mapping):
            raise WireFormatError(f"sglang [{index}]: expected an object with 'meta_info'")
        blob = decoded_blob(meta_info.get(field), what)
        per_row = layers * k
        if len(blob) % (per_row * _INT32.itemsize):
            raise WireFormatError(
                f"{what}: expected a multiple of {per_row} int32 ids (layers {layers} x "
                f"topk {k}), found {len(blob)} bytes"
            )
        routes = np.frombuffer(blob, dtype=_INT32).reshape(-1, layers, k)
        first = start_arg
        if first is None:
            first = optional_position(
                meta_info.get("routed_experts_start_len"),
                f"{what}: routed_experts_start_len",
                WireFormatError,
            )
        prompt_len = optional_position(
            meta_info.get("prompt_tokens"), f"{what}: prompt_tokens", WireFormatError
        )
        completion_len = optional_position(
            meta_info.get("completion_tokens"), f"{what}: completion_tokens", WireFormatError
        )
        pos = anchored_pos(routes.shape[0], prompt_len, completion_len, first or 0, what=what)
        out += screened_rows(
            field,
            routes,
            pos,
            on_zero,
            what,
            producer="sglang",
            choice=index,
            prompt_len=prompt_len,
            completion_len=completion_len,
        )
    return out
