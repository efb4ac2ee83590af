"""NeMo-RL: routes as a string ``"nrlre1:<dtype>:<S>x<L>x<K>:<base64>"`` in each choice's message.

What NeMo-RL's vLLM generation worker attaches to chat responses (NVIDIA-NeMo/RL at
7ea279abf: nemo_rl/models/generation/vllm/utils.py
``attach_routed_experts_to_chat_response_choices``, nemo_rl/utils/routed_experts_codec.py
``encode_routed_experts``, ``pad_and_align_routed_expert_indices``):

- ``choices[i].message.routed_experts``: the string above (legacy: nested JSON lists), raw
  C-ordered ids of ``int8`` (<= 128 experts), ``int16`` (<= 32768) or ``int32``, by the
  model's expert count.
- ``S = prompt + completion``: one row per token, **including the last**, which no forward
  produced (NeMo-RL writes ``arange(topk)`` there); it is dropped, so rows cover
  ``[0, prompt + completion - 1)``. Rows vLLM did not return are all -1: no route there (the
  loader's screen finds them missing). No prompt start: rows always start at 0.
- ``L`` is vLLM's layer axis: every decoder layer, dense ones zero.
- With token information asked for, ``message.prompt_token_ids`` and
  ``message.generation_token_ids`` (vllm/utils.py
  ``attach_token_information_to_chat_response_choices``): their lengths check ``S``.

The string is no base64 blob a splice can cut out (it has a prefix), so the body is parsed
plainly and the blob's characters are copied once into bytes; they stay encoded until the
loader decodes them into the batch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from r3data.errors import EngineRoutesError, WireFormatError
from r3data.wire.blob import decoded_length
from r3data.wire.dtypes import parse_dtype
from r3data.wire.envelope import check_nbytes
from r3data.wire.producers.base import (
    ROUTES_FIELD,
    Choice,
    ChoiceOptions,
    ChoiceRows,
    EngineRequest,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    any_choice,
    array_base64,
    choice_token_lengths,
    nested_rows,
)
from r3data.wire.rows import EncodedRows, InlineRows, RowSource

__all__ = ["FORMAT", "NemoRlFormat", "carry_dtype", "encode_routes"]

MAGIC = "nrlre1:"
_HEADER = re.compile(r"nrlre1:(int8|int16|int32):([0-9]{1,12})x([0-9]{1,6})x([0-9]{1,6}):")
_DTYPES = ("int8", "int16", "int32")


def carry_dtype(num_experts: int | None) -> np.dtype:
    """NeMo-RL's dtype by the model's expert count (int16 when unknown): signed, for -1."""
    if num_experts is None:
        return np.dtype(np.int16)
    if num_experts - 1 <= np.iinfo(np.int8).max:
        return np.dtype(np.int8)
    return np.dtype(np.int16 if num_experts - 1 <= np.iinfo(np.int16).max else np.int32)


def encode_routes(rows: np.ndarray) -> str:
    """``encode_routed_experts``: the ``nrlre1`` string of ``[S, L, K]`` rows."""
    rows = np.ascontiguousarray(rows)
    tokens, layers, topk = rows.shape
    return f"{MAGIC}{rows.dtype.name}:{tokens}x{layers}x{topk}:{array_base64(rows)}"


def _string_rows(value: str, meta: dict[str, Any], what: str) -> tuple[RowSource, int]:
    """The rows of an ``nrlre1`` string but its last, and ``S``."""
    match = _HEADER.match(value[:64])
    if match is None:
        raise WireFormatError(
            f"{what}: expected 'nrlre1:<int8|int16|int32>:<S>x<L>x<K>:<base64>', found "
            f"{value[:40]!r}"
        )
    dtype = parse_dtype(match.group(1), _DTYPES)
    tokens, layers, topk = (int(n) for n in match.groups()[1:])
    try:
        chars = memoryview(value[match.end() :].encode("ascii"))
    except UnicodeEncodeError:
        raise WireFormatError(f"{what}: expected base64 after the header") from None
    check_nbytes(decoded_length(chars, what), dtype, (tokens, layers, topk), what=what)
    if not layers or not topk:
        raise WireFormatError(
            f"{what}: expected rows of layers > 0 x topk > 0, found {layers}x{topk}"
        )
    rows = EncodedRows(
        ROUTES_FIELD,
        chars,
        dtype=dtype,
        row_shape=(layers, topk),
        rows=max(tokens - 1, 0),
        pos=0,
        meta=meta,
        what=what,
    )
    return rows, tokens


def _message_routes(choice: Mapping[str, Any]) -> object:
    """A choice's ``message.routed_experts``, else None."""
    message = choice.get("message")
    return message.get(ROUTES_FIELD) if isinstance(message, Mapping) else None


def _token_lengths(
    response: Mapping[str, Any], choice: Mapping[str, Any], what: str
) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` from the token ids NeMo-RL attaches to the message
    (``prompt_token_ids``, ``generation_token_ids``: vllm/utils.py
    ``attach_token_information_to_chat_response_choices``), else vLLM's own lists; both
    present, they must agree."""
    message = choice.get("message")
    ids = message if isinstance(message, Mapping) else {}
    attached = (ids.get("prompt_token_ids"), ids.get("generation_token_ids"))
    found = [len(v) if isinstance(v, list) else None for v in attached]
    own_lengths = choice_token_lengths(response, choice)
    for i, (side, own) in enumerate(zip(("prompt", "completion"), own_lengths, strict=True)):
        if found[i] is None:
            found[i] = own
        elif own is not None and own != found[i]:
            raise WireFormatError(
                f"{what}: expected the message's {side} ids to count what vLLM's own do "
                f"({own}), found {found[i]}"
            )
    return found[0], found[1]


def _sends_nemorl(choice: Mapping[str, Any]) -> bool:
    """Whether a choice's message carries an ``nrlre1`` string or (legacy) nested lists."""
    value = _message_routes(choice)
    return (isinstance(value, str) and value.startswith(MAGIC)) or isinstance(value, list)


class NemoRlFormat(ProducerFormat):
    name = "nemo-rl"
    producer = "NeMo-RL"
    versions = "main 7ea279abf (nrlre1 strings; legacy nested lists)"
    options = ChoiceOptions
    prompt_start = False

    def recognise(self, doc: Any) -> bool:
        return any_choice(doc, _sends_nemorl)

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}].message.{ROUTES_FIELD}"
        prompt, completion = choice.placed(
            what, _token_lengths(choice.response, choice.entry, what)
        )
        value = _message_routes(choice.entry)
        if value is None:
            return ChoiceRows(choice.index, (), (what,))
        meta = self.rows_meta(choice, prompt, completion)
        if isinstance(value, str):
            rows, tokens = _string_rows(value, meta, what)
        else:
            full = nested_rows(value, 3, what)
            rows, tokens = InlineRows(ROUTES_FIELD, full[:-1], 0, meta), full.shape[0]
        if prompt is not None and completion is not None and tokens != prompt + completion:
            raise EngineRoutesError(
                f"{what}: expected {prompt + completion} rows (prompt {prompt} + completion "
                f"{completion}, the last a placeholder), found {tokens}"
            )
        return ChoiceRows(choice.index, (rows,))

    def encode(self, request: EngineRequest) -> bytes:
        """A chat body with ``message.routed_experts`` (rows from 0, the last ``arange``)."""
        self.check_start(request)
        topk = request.routes.shape[2]
        last = np.broadcast_to(np.arange(topk), (1, *request.routes.shape[1:]))
        dtype = carry_dtype(request.num_experts)
        rows = np.concatenate([request.routes, last]).astype(dtype)
        message = {
            "role": "assistant",
            "content": "",
            ROUTES_FIELD: encode_routes(rows),
            "prompt_token_ids": [int(t) for t in request.prompt_ids],
            "generation_token_ids": [int(t) for t in request.completion_ids],
        }
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        body = {"object": "chat.completion", "model": "r3data-synth", "choices": [choice]}
        return orjson.dumps(body)


FORMAT = NemoRlFormat()
