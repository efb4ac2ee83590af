"""vLLM: routed experts as a base64 ``.npy`` file per choice.

What vLLM's OpenAI server returns (``CompletionResponseChoice.routed_experts``, and the same
field on chat choices), with ``--enable-return-routed-experts``:

- ``choices[i].routed_experts``: base64 of ``np.save`` bytes, shape ``(tokens - 1,
  num_hidden_layers, num_experts_per_tok)``, uint8 when the model has <= 256 experts, else
  uint16 (int32 in older builds); ``null`` when the request was aborted before any forward
  pass or the server has the feature off. ``tokens`` is prompt plus completion: the last
  sampled token is never forwarded, so it has no routes.
- ``routed_experts_prompt_start`` is a request field ("skip the first N prompt tokens from
  returned routed-expert data"), not echoed in the response: rows then start at that
  position. Pass it as ``prompt_start`` (a proxy that echoes it in the choice or the response
  top level is honoured too).
- Dense layers appear as all-zero rows; some engine bugs return correctly shaped all-zero
  arrays (see :func:`~r3data.wire.producers.common.screen_routes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from r3data.errors import ConfigError, WireFormatError
from r3data.wire.anchors import anchored_pos
from r3data.wire.blob import Blob, decode_base64
from r3data.wire.dtypes import ROUTE_DTYPES
from r3data.wire.envelope import check_nbytes
from r3data.wire.npy import NPY_PREFIX_BYTES, npy_header_length, parse_npy_header
from r3data.wire.producers.common import (
    blob_nbytes,
    check_route_shape,
    choice_token_lengths,
    flat_rows,
    optional_position,
    parse_response,
    raw_blob,
    select_choices,
)
from r3data.wire.rows import RowSource

__all__ = ["read_npy", "vllm_routes"]


def _header_of(blob: bytes | bytearray | memoryview | Blob | str, what: str) -> bytes:
    """The ``.npy`` header bytes of a blob, decoding only the first characters if encoded."""
    if not isinstance(blob, Blob | str):
        view = memoryview(blob).cast("B")
        return bytes(view[: npy_header_length(view[:NPY_PREFIX_BYTES].tobytes(), what)])
    chars = blob.chars if isinstance(blob, Blob) else blob
    prefix = bytes(decode_base64(chars[:16], what=what))  # 12 bytes: magic, version, length
    length = npy_header_length(prefix, what)
    return bytes(decode_base64(chars[: 4 * -(-length // 3)], what=what))[:length]


def npy_routes(
    field: str, value: object, *, pos: int, meta: Mapping[str, Any] | None, what: str
) -> RowSource:
    """The route rows of a ``.npy`` blob (encoded or decoded): C-ordered ``[rows, layers,
    topk]`` of a route dtype, exactly as many bytes as the header claims."""
    blob = raw_blob(value, what)
    dtype, shape, fortran, offset = parse_npy_header(_header_of(blob, what), what, ROUTE_DTYPES)
    if fortran or len(shape) != 3:
        raise WireFormatError(
            f"{what}: expected a C-ordered [rows, layers, topk] array, found shape {shape}"
            f"{' in Fortran order' if fortran else ''}"
        )
    check_nbytes(blob_nbytes(blob, what) - offset, dtype, shape, what=what)
    rows = flat_rows(
        field, blob, dtype=dtype, row_shape=shape[1:], pos=pos, skip=offset, meta=meta, what=what
    )
    check_route_shape(rows, what)
    return rows


def read_npy(buffer: bytes | bytearray | memoryview, *, what: str = "npy") -> np.ndarray:
    """A view of the 3-D route array in decoded ``.npy`` bytes; only the header is copied."""
    rows = npy_routes("routes", buffer, pos=0, meta=None, what=what)
    return rows.array


def vllm_routes(
    response: Any,
    *,
    choice: int | None = None,
    prompt_start: int | None = None,
    field: str = "routed_experts",
) -> list[RowSource]:
    """Routes of each choice (or of ``choice``) of a vLLM completion or chat response.

    ``response`` is the raw body (spliced with :func:`~r3data.wire.load_packed_body`, blobs
    left encoded) or a parsed one. Rows start at ``prompt_start`` (the request's
    ``routed_experts_prompt_start``, default 0). When the choice carries token ids, the row
    count is checked against ``prompt + completion - 1 - start``. ``meta`` holds
    ``producer``, ``choice``, ``prompt_len`` and ``completion_len``.
    """
    start_arg = optional_position(prompt_start, "prompt_start", ConfigError)
    parsed = parse_response(response, (field,))
    out = []
    for index, entry in select_choices(parsed, choice, "vllm response"):
        what = f"vllm choices[{index}].{field}"
        start = start_arg
        for source in (entry, parsed):
            if start is None:
                start = optional_position(
                    source.get("routed_experts_prompt_start"),
                    f"{what}: routed_experts_prompt_start",
                    WireFormatError,
                )
        prompt_len, completion_len = choice_token_lengths(parsed, entry)
        meta = {
            "producer": "vllm",
            "choice": index,
            "prompt_len": prompt_len,
            "completion_len": completion_len,
        }
        rows = npy_routes(field, entry.get(field), pos=start or 0, meta=meta, what=what)
        anchored_pos(rows.rows, prompt_len, completion_len, start or 0, what=what)
        out.append(rows)
    return out
