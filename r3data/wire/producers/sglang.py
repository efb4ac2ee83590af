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
from r3data.validate import checked_int
from r3data.wire.anchors import anchored_pos
from r3data.wire.producers.common import (
    blob_nbytes,
    flat_rows,
    optional_position,
    parse_response,
)
from r3data.wire.rows import RowSource

__all__ = ["sglang_routes"]

_INT32 = np.dtype("<i4")


def sglang_routes(
    response: Any,
    *,
    num_layers: int,
    topk: int,
    start: int | None = None,
    field: str = "routed_experts",
) -> list[RowSource]:
    """Routes of an SGLang ``/generate`` response (one object or a batch list), one per item.

    ``num_layers`` and ``topk`` shape the flat ids; the int32 count must divide exactly.
    ``start`` overrides ``meta_info.routed_experts_start_len`` (default 0). ``meta`` holds
    ``producer``, ``choice`` (the item's index in a batch list), ``prompt_len``,
    ``completion_len``.
    """
    layers = checked_int("sglang_routes num_layers", num_layers, minimum=1)
    k = checked_int("sglang_routes topk", topk, minimum=1)
    start_arg = optional_position(start, "start", ConfigError)
    parsed = parse_response(response, (field,))
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for index, item in enumerate(items):
        what = f"sglang [{index}].meta_info.{field}"
        meta_info = item.get("meta_info") if isinstance(item, Mapping) else None
        if not isinstance(meta_info, Mapping):
            raise WireFormatError(f"sglang [{index}]: expected an object with 'meta_info'")
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
        meta = {
            "producer": "sglang",
            "choice": index,
            "prompt_len": prompt_len,
            "completion_len": completion_len,
        }
        per_row = layers * k
        if blob_nbytes(meta_info.get(field), what) % (per_row * _INT32.itemsize):
            raise WireFormatError(
                f"{what}: expected a multiple of {per_row} int32 ids (layers {layers} x "
                f"topk {k}), found {blob_nbytes(meta_info.get(field), what)} bytes"
            )
        rows = flat_rows(
            field,
            meta_info.get(field),
            dtype=_INT32,
            row_shape=(layers, k),
            pos=first or 0,
            meta=meta,
            what=what,
        )
        anchored_pos(rows.rows, prompt_len, completion_len, first or 0, what=what)
        out.append(rows)
    return out
