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

import io
import tokenize
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from r3data.errors import ConfigError, WireFormatError
from r3data.wire.anchors import anchored_pos
from r3data.wire.dtypes import ROUTE_DTYPES, parse_dtype
from r3data.wire.envelope import array_from_buffer
from r3data.wire.producers.common import (
    OnZero,
    choice_token_lengths,
    decoded_blob,
    optional_position,
    parse_response,
    screened_rows,
    select_choices,
)
from r3data.wire.rows import InlineRows

__all__ = ["read_npy", "vllm_routes"]

_NPY_HEADER_MAX = 10_000  # numpy's own limit on a header it will parse
_NPY_PREFIX_MAX = _NPY_HEADER_MAX + 16  # magic, version and header length come first


def read_npy(buffer: bytes | bytearray | memoryview, *, what: str = "npy") -> np.ndarray:
    """A view of the 3-D route array in ``.npy`` bytes; only the header is copied.

    The header is parsed with :mod:`numpy.lib.format` (a literal, never a pickle); the dtype
    must be a route dtype and the data C-ordered, exactly as long as the header claims.
    """
    view = memoryview(buffer).cast("B")
    head = io.BytesIO(view[:_NPY_PREFIX_MAX].tobytes())
    try:
        version = npy_format.read_magic(head)
        if version == (1, 0):
            header = npy_format.read_array_header_1_0(head, max_header_size=_NPY_HEADER_MAX)
        elif version == (2, 0):
            header = npy_format.read_array_header_2_0(head, max_header_size=_NPY_HEADER_MAX)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, TypeError, SyntaxError, EOFError, tokenize.TokenError) as err:
        raise WireFormatError(f"{what}: expected a .npy file ({err})") from None
    shape, fortran_order, dtype = header
    dtype = parse_dtype(dtype, ROUTE_DTYPES)
    if fortran_order or len(shape) != 3:
        raise WireFormatError(
            f"{what}: expected a C-ordered [rows, layers, topk] array, found shape {shape}"
            f"{' in Fortran order' if fortran_order else ''}"
        )
    return array_from_buffer(view[head.tell() :], dtype, tuple(shape), what=what)


def vllm_routes(
    response: Any,
    *,
    choice: int | None = None,
    prompt_start: int | None = None,
    on_zero: OnZero = "raise",
    field: str = "routed_experts",
) -> list[InlineRows]:
    """Routes of each choice (or of ``choice``) of a vLLM completion or chat response.

    ``response`` is the raw body (spliced with :func:`~r3data.wire.load_packed_body`) or a
    parsed one. Rows start at ``prompt_start`` (the request's ``routed_experts_prompt_start``,
    default 0). When the choice carries token ids, the row count is checked against
    ``prompt + completion - 1 - start``. ``meta`` holds ``producer``, ``choice``,
    ``prompt_len``, ``completion_len`` and ``dense_layers``.
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
        routes = read_npy(decoded_blob(entry.get(field), what), what=what)
        prompt_len, completion_len = choice_token_lengths(parsed, entry)
        pos = anchored_pos(routes.shape[0], prompt_len, completion_len, start or 0, what=what)
        out += screened_rows(
            field,
            routes,
            pos,
            on_zero,
            what,
            producer="vllm",
            choice=index,
            prompt_len=prompt_len,
            completion_len=completion_len,
        )
    return out
