"""vLLM 0.22.0-0.34.0: routed experts as a base64 ``.npy`` file per choice.

What vLLM's servers return with ``--enable-return-routed-experts`` (sources: vllm wheels at
each release; model_executor/layers/fused_moe/routed_experts_capturer.py, utils/
serial_utils.py ``numpy2base64``, entrypoints/openai/{completion,chat_completion}/serving.py,
entrypoints/scale_out/token_in_token_out/serving.py):

- ``choices[i].routed_experts``: base64 of ``np.save`` bytes, ``[rows, num_hidden_layers,
  num_experts_per_tok]`` (dense layers all zero), uint8 when the model has <= 256 experts,
  else uint16; ``null`` when the request was aborted before any forward pass. Rows cover
  ``[start, prompt + completion - 1)``: the last sampled token is never forwarded.
- ``start`` is the request's ``routed_experts_prompt_start`` (OpenAI requests from 0.28.0,
  the tokens endpoint's ``sampling_params`` from 0.22.0); vLLM does not echo it.
- Completions put ``prompt_token_ids`` in each choice (one choice per prompt and sample,
  prompt-major, ``index`` a running count), chat at the top level; both only with
  ``return_token_ids``. ``echo`` changes the text, not the routes.
- The tokens endpoint ``/inference/v1/generate`` has the same per-choice field; its stream
  (0.24.0+) sends a choice's routes only on the chunk that finishes it, holding the whole
  request's rows. The OpenAI streams carry no routes at all.
- The tokens endpoint's ``choices[i].sampling_mask`` (0.30.0+, ``return_sampling_mask``):
  per completion token the list of vocabulary ids the sampler kept (top-k > 0 required),
  row i at ``prompt + i``; a stream sends each delta's rows with its tokens. They become
  ``sampling_mask`` rows.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
import pybase64

from r3data.errors import WireFormatError
from r3data.validate import nonnegative_int
from r3data.wire.anchors import anchored_pos
from r3data.wire.blob import Blob, decode_base64
from r3data.wire.dtypes import ROUTE_DTYPES, compact_route_dtype
from r3data.wire.envelope import check_nbytes
from r3data.wire.npy import NPY_PREFIX_BYTES, npy_header_length, parse_npy_header
from r3data.wire.producers.base import (
    MASK_FIELD,
    ROUTES_FIELD,
    Choice,
    ChoiceRows,
    EngineRequest,
    ProducerFormat,
    StartOptions,
)
from r3data.wire.producers.common import (
    any_choice,
    blob_nbytes,
    blob_rows,
    check_route_shape,
    check_stream_choices,
    documents,
    encoded_chars,
    kept_id_rows,
    openai_usage,
    parse_response,
    raw_blob,
    sources_of,
    stream_events,
)
from r3data.wire.rows import RowSource

__all__ = [
    "FORMAT",
    "VllmFormat",
    "completion_choice",
    "npy_base64",
    "npy_routes",
    "read_npy",
    "vllm_routes",
]

_NPY_BASE64 = "k05VTVBZ"
"""How base64 of a ``.npy`` file begins (``\\x93NUMPY``)."""


_HEAD_CHARS = 172
"""Base64 characters decoded first: 129 bytes, more than ``np.save``'s 128-byte header of a
3-D array, so one decode usually reads the whole header."""


def _header_of(
    blob: bytes | bytearray | memoryview, chars: memoryview | str | None, what: str
) -> bytes | bytearray:
    """The first bytes of a ``.npy`` blob, its whole header at least (unless the blob is
    shorter), decoding only the first characters of ``chars`` (its base64,
    :func:`~.common.encoded_chars`) if encoded."""
    if chars is None:
        view = memoryview(blob).cast("B")
        return bytes(view[: npy_header_length(view[:NPY_PREFIX_BYTES].tobytes(), what)])
    head = decode_base64(chars[:_HEAD_CHARS], what=what)
    length = npy_header_length(head, what)
    if length > len(head):
        head = decode_base64(chars[: 4 * -(-length // 3)], what=what)
    return head


def npy_routes(
    field: str, value: object, *, pos: int, meta: Mapping[str, Any] | None, what: str
) -> RowSource:
    """The route rows of a ``.npy`` blob (encoded or decoded): C-ordered ``[rows, layers,
    topk]`` of a route dtype, exactly as many bytes as the header claims."""
    blob = raw_blob(value, what)
    chars = encoded_chars(blob)
    head = _header_of(blob, chars, what)
    dtype, shape, fortran, offset = parse_npy_header(head, what, ROUTE_DTYPES)
    if fortran or len(shape) != 3:
        raise WireFormatError(
            f"{what}: expected a C-ordered [rows, layers, topk] array, found shape {shape}"
            f"{' in Fortran order' if fortran else ''}"
        )
    check_nbytes(blob_nbytes(blob, what) - offset, dtype, shape, what=what)
    rows = blob_rows(
        field, blob, dtype=dtype, shape=shape, pos=pos, skip=offset, meta=meta, what=what
    )
    check_route_shape(rows, what)
    return rows


def npy_base64(rows: np.ndarray) -> str:
    """Base64 of ``np.save(rows)``, as vLLM's ``numpy2base64`` writes it."""
    with io.BytesIO() as buffer:
        np.save(buffer, rows, allow_pickle=False)
        return pybase64.b64encode_as_string(buffer.getbuffer())


def read_npy(buffer: bytes | bytearray | memoryview, *, what: str = "npy") -> np.ndarray:
    """A view of the 3-D route array in decoded ``.npy`` bytes; only the header is copied."""
    return npy_routes(ROUTES_FIELD, buffer, pos=0, meta=None, what=what).array


def _assemble(raw: Any, what: str) -> dict[str, Any]:
    """One response from a tokens-endpoint stream: per choice index its token ids in order
    and its routes, which vLLM sends once, on the chunk that finishes the choice."""
    top: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    routed_at: dict[int, int] = {}
    for number, event in enumerate(stream_events(raw, what)):
        where = f"{what} event {number}"
        chunk = parse_response(event, (ROUTES_FIELD,))
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("choices"), list):
            raise WireFormatError(f"{where}: expected a chunk with a 'choices' list")
        prompt = chunk.get("prompt_token_ids")
        if prompt is not None and top.setdefault("prompt_token_ids", prompt) != prompt:
            raise WireFormatError(
                f"{where}: expected the prompt_token_ids an earlier chunk sent (vLLM sends "
                f"them once, on the first), found different ones"
            )
        for part in chunk["choices"]:
            if not isinstance(part, Mapping):
                raise WireFormatError(f"{where}: expected choice objects")
            index = nonnegative_int(f"{where} choices[].index", part.get("index"), WireFormatError)
            merged = choices.setdefault(index, {"index": index, "token_ids": []})
            ids = part.get("token_ids")
            if isinstance(ids, list) and isinstance(merged["token_ids"], list):
                merged["token_ids"].extend(ids)
            else:
                merged["token_ids"] = None  # a chunk without ids: the count is unknown
            mask = part.get(MASK_FIELD)
            if mask is not None:  # the rows of this delta's tokens
                if not isinstance(mask, list):
                    raise WireFormatError(
                        f"{where}: choice {index} {MASK_FIELD}: expected a list of kept-id "
                        f"lists, found {type(mask).__name__}"
                    )
                if isinstance(ids, list) and len(mask) != len(ids):
                    raise WireFormatError(
                        f"{where}: choice {index} {MASK_FIELD}: expected one kept set per token "
                        f"of the delta ({len(ids)}), found {len(mask)}"
                    )
                merged.setdefault(MASK_FIELD, []).extend(mask)
            routes = part.get(ROUTES_FIELD)
            if routes is None:
                continue
            if index in routed_at:
                raise WireFormatError(
                    f"{where}: choice {index} carries routes again (first on event "
                    f"{routed_at[index]}); vLLM sends them once, on the finishing chunk"
                )
            if part.get("finish_reason") is None:
                raise WireFormatError(
                    f"{where}: choice {index} carries routes before it finished; vLLM sends "
                    f"them on the finishing chunk, for the whole request"
                )
            routed_at[index] = number
            merged[ROUTES_FIELD] = routes
    count = check_stream_choices(choices, what)
    return {**top, "choices": [choices[i] for i in range(count)]}


def _is_npy(value: object) -> bool:
    if isinstance(value, Blob):
        return bytes(value.chars[:8]) == _NPY_BASE64.encode()
    return isinstance(value, str) and value.startswith(_NPY_BASE64)


def _sends_vllm_rows(choice: Mapping[str, Any]) -> bool:
    """A ``.npy`` string of routes, or a native mask beside null routes (not an envelope)."""
    routes = choice.get(ROUTES_FIELD)
    return _is_npy(routes) or (routes is None and isinstance(choice.get(MASK_FIELD), list))


def _sends_npy(doc: object) -> bool:
    return (
        isinstance(doc, Mapping)
        and "prompt_routed_experts" not in doc
        and any_choice(doc, _sends_vllm_rows)
    )


def _vllm_dtype(num_experts: int | None, routes: np.ndarray) -> np.dtype:
    """vLLM's expert-id dtype: by the model's expert count (default: by the ids present)."""
    if num_experts is not None:
        return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)
    return compact_route_dtype(int(routes.max(initial=0)))


def completion_choice(request: EngineRequest, routes: object) -> dict[str, Any]:
    """A ``/v1/completions`` choice with ``return_token_ids`` (vLLM's field order, 0.21-0.33)
    whose ``routed_experts`` are ``routes``."""
    return {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [int(t) for t in request.completion_ids],
        "prompt_logprobs": None,
        "prompt_token_ids": [int(t) for t in request.prompt_ids],
        ROUTES_FIELD: routes,
    }


class VllmFormat(ProducerFormat):
    name = "vllm"
    producer = "vLLM"
    versions = "0.22.0-0.34.0 (OpenAI completions and chat; tokens endpoint and its stream)"
    fields = (ROUTES_FIELD, MASK_FIELD)
    options = StartOptions
    spliced = (ROUTES_FIELD,)
    stream_assembler = staticmethod(_assemble)

    def recognise(self, doc: Any) -> bool:
        return any(_sends_npy(event) for event in documents(doc))

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}].{ROUTES_FIELD}"
        prompt, completion = choice.placed(what)
        meta = self.rows_meta(choice, prompt, completion)
        sources: list[RowSource] = []
        missing: tuple[str, ...] = ()
        value = choice.entry.get(ROUTES_FIELD)
        if choice.wants(ROUTES_FIELD) and value is None:
            missing = (what,)
        elif choice.wants(ROUTES_FIELD):
            start = self.start_of(choice.options)
            rows = npy_routes(ROUTES_FIELD, value, pos=start, meta=meta, what=what)
            anchored_pos(rows.rows, prompt, completion, start, what=what)
            sources.append(rows)
        mask = choice.entry.get(MASK_FIELD)
        if choice.wants(MASK_FIELD) and mask is not None:
            where = f"{self.name} choices[{choice.index}].{MASK_FIELD}"
            sources.append(kept_id_rows(MASK_FIELD, mask, prompt, completion, meta, where))
        return ChoiceRows(choice.index, tuple(sources), missing)

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/v1/completions`` body with ``return_token_ids`` (0.33 field order)."""
        routes = request.routes.astype(_vllm_dtype(request.num_experts, request.routes))
        choice = completion_choice(request, npy_base64(routes))
        body = {"object": "text_completion", "model": "r3data-synth", "choices": [choice]}
        return orjson.dumps({**body, "usage": openai_usage(request)})


FORMAT = VllmFormat()


def vllm_routes(
    response: Any, *, choice: int | None = None, prompt_start: int | None = None
) -> list[RowSource]:
    """Routes of each choice (or of ``choice``) of a vLLM response: the ``"vllm"`` format's
    rows. ``prompt_start`` is the request's ``routed_experts_prompt_start`` (default 0)."""
    options = StartOptions(choice=choice, start=0 if prompt_start is None else prompt_start)
    return sources_of(FORMAT.decode(response, options, fields=frozenset({ROUTES_FIELD})))
