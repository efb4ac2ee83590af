"""NVIDIA Dynamo in front of vLLM workers: a response-level ``nvext.routed_experts`` envelope.

What Dynamo's OpenAI frontend returns for ``/v1/chat/completions`` and ``/v1/completions``
when the request asks for it with ``"nvext": {"extra_fields": ["routed_experts"]}`` and the
vLLM worker runs with ``--enable-return-routed-experts`` (sources: github ai-dynamo/dynamo,
PR #10529 "serialize routed_experts as base64 with start offset", merged 2026-06-10, and main
at 000a36a7399a; components/src/dynamo/vllm/handlers.py ``_serialize_routed_experts``,
response_adapters.py ``serialize_legacy_routed_experts`` / ``LegacyResponseAdapter``;
lib/llm/src/protocols/openai/nvext.rs ``NvExtResponseFieldSelection::build_response_nvext``,
``merge_response_nvext``; chat_completions/{delta,aggregator}.rs, completions/delta.rs):

- The worker serialises vLLM's ``CompletionOutput.routed_experts`` (a ``[rows,
  num_hidden_layers, topk]`` array, dense layers zero) on the chunk that finishes a choice as
  ``{"data": base64 of its C-ordered bytes (no header), "shape": [rows, layers, topk],
  "start": min(routed_experts_prompt_start, prompt length), "dtype": numpy's name}`` (vLLM's
  uint8 / uint16, int32 in older vLLM builds) and passes it in ``engine_data``; the frontend
  copies it, as it is, into that chunk's **response-level** ``nvext.routed_experts`` (and into
  ``nvext.engine_data.routed_experts`` when ``engine_data`` is asked for too). Rows cover
  ``[start, start + rows)``, ending at ``prompt + completion - 1``: the body states its start.
- A stream chunk holds one choice (``index``); the routes come on the chunk whose
  ``finish_reason`` closes that choice, once. A non-stream response folds the chunks: their
  ``nvext`` objects are merged key by key, the last writer winning, so with several choices
  it holds one choice's routes and does not say whose; this format refuses such a body
  (stream it, or send ``n = 1``).
- The body carries no token ids unless asked (``nvext.completion_token_ids``, one choice
  only); ``usage`` gives the lengths when the response has one choice.
- Earlier Dynamo (PR #9651, merged 2026-05) sent ``{"data": base85, "shape"}`` with neither
  ``start`` nor ``dtype``: refused. The SGLang worker sends SGLang's own base64 of flat int32
  ids under the same key (request_handlers/llm/decode_handler.py): not this format; the
  TRT-LLM worker's payload was not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from r3data.errors import WireFormatError
from r3data.validate import nonnegative_int
from r3data.wire.blob import Blob
from r3data.wire.dtypes import compact_route_dtype
from r3data.wire.producers.base import (
    ROUTES_FIELD,
    Choice,
    ChoiceOptions,
    ChoiceRows,
    EngineRequest,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    array_base64,
    check_stream_choices,
    documents,
    openai_usage,
    parse_response,
    stream_events,
    token_counts,
)
from r3data.wire.producers.primerl import envelope_route_rows

__all__ = ["FORMAT", "DynamoVllmFormat"]

NVEXT = "nvext"
ENVELOPE_KEYS = ("data", "shape", "start", "dtype")
"""What the vLLM worker's envelope holds (PR #10529 on)."""
_ROUTED = ("r3data", "dynamo routes by choice")
"""Key of an assembled stream (no JSON key can be it): each choice's envelope, by index."""


def _same_value(a: object, b: object) -> bool:
    """Whether two parsed JSON values are the same: a spliced blob by its characters (its
    ``what`` names its offset), a decoded one by dtype, shape and bytes."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, Blob) or isinstance(b, Blob):
        return isinstance(a, Blob) and isinstance(b, Blob) and a.chars == b.chars
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    return type(a) is type(b) and a == b


def _nvext_routes(doc: object, what: str, *, compare: bool = True) -> object:
    """The envelope of a response's (or chunk's) ``nvext``: ``routed_experts``, else
    ``engine_data.routed_experts`` (the same object, sent when only ``engine_data`` was
    asked for); None when neither is there. Where both are sent they must be the same
    (``compare``): the frontend copies the one into the other."""
    nvext = doc.get(NVEXT) if isinstance(doc, Mapping) else None
    if nvext is None:
        return None
    if not isinstance(nvext, Mapping):
        raise WireFormatError(
            f"{what}: expected '{NVEXT}' to be an object, found {type(nvext).__name__}"
        )
    routes = nvext.get(ROUTES_FIELD)
    engine_data = nvext.get("engine_data")
    copied = engine_data.get(ROUTES_FIELD) if isinstance(engine_data, Mapping) else None
    if routes is None:
        return copied
    if compare and copied is not None and not _same_value(routes, copied):
        raise WireFormatError(
            f"{what}: {NVEXT}.engine_data.{ROUTES_FIELD} differs from {NVEXT}.{ROUTES_FIELD}; "
            f"expected the same envelope (Dynamo's frontend copies the one into the other)"
        )
    return routes


def _sends_envelope(doc: object) -> bool:
    try:
        routes = _nvext_routes(doc, "body", compare=False)
    except WireFormatError:
        return False
    return isinstance(routes, Mapping) and "data" in routes and "shape" in routes


def _assemble(raw: Any, what: str) -> dict[Any, Any]:
    """One response from a stream: the choices seen, each one's envelope (sent once, on the
    chunk that finishes it; Dynamo's chunks hold one choice each) and the last usage."""
    indices: dict[int, None] = {}
    routed: dict[int, object] = {}
    merged: dict[Any, Any] = {}
    for number, event in enumerate(stream_events(raw, what)):
        where = f"{what} event {number}"
        chunk = parse_response(event, (ROUTES_FIELD,))
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("choices"), list):
            raise WireFormatError(f"{where}: expected a chunk with a 'choices' list")
        parts = chunk["choices"]
        for part in parts:
            index = part.get("index") if isinstance(part, Mapping) else None
            indices.setdefault(nonnegative_int(f"{where} choices[].index", index, WireFormatError))
        routes = _nvext_routes(chunk, where)
        if routes is not None:
            if len(parts) != 1:
                raise WireFormatError(
                    f"{where}: expected {NVEXT}.{ROUTES_FIELD} on a chunk of one choice (Dynamo "
                    f"streams one choice per chunk), found {len(parts)} choices"
                )
            index = parts[0]["index"]
            if index in routed:
                raise WireFormatError(
                    f"{where}: choice {index} carries routes again; Dynamo sends them once, on "
                    f"the chunk that finishes the choice"
                )
            if parts[0].get("finish_reason") is None:
                raise WireFormatError(
                    f"{where}: choice {index} carries routes before it finished; Dynamo sends "
                    f"them on the chunk that finishes it"
                )
            routed[index] = routes
        if chunk.get("usage") is not None:
            merged["usage"] = chunk["usage"]
        if "object" in chunk:
            merged.setdefault("object", chunk["object"])
    count = check_stream_choices(indices, what)
    return {**merged, _ROUTED: routed, "choices": [{"index": i} for i in range(count)]}


def _lengths(response: Mapping[str, Any], what: str) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` a one-choice response states: ``usage``'s counts and
    the length of ``nvext.completion_token_ids``, which must agree where both are sent."""
    usage = response.get("usage")
    prompt, completion = (
        token_counts(usage, "usage.") if isinstance(usage, Mapping) else (None, None)
    )
    nvext = response.get(NVEXT)
    ids = nvext.get("completion_token_ids") if isinstance(nvext, Mapping) else None
    if ids is None:
        return prompt, completion
    if type(ids) is not list:
        raise WireFormatError(
            f"{what}: expected {NVEXT}.completion_token_ids to be a list of token ids, found "
            f"{type(ids).__name__}"
        )
    if completion is not None and completion != len(ids):
        raise WireFormatError(
            f"{what}: usage.completion_tokens is {completion} but {NVEXT}.completion_token_ids "
            f"holds {len(ids)} ids"
        )
    return prompt, len(ids)


class DynamoVllmFormat(ProducerFormat):
    name = "dynamo-vllm"
    producer = "NVIDIA Dynamo (vLLM workers)"
    versions = (
        "main from PR #10529 (2026-06-10), checked at 000a36a7399a: OpenAI chat and "
        "completions, their streams"
    )
    options = ChoiceOptions
    spliced = (ROUTES_FIELD,)
    stream_assembler = staticmethod(_assemble)

    def recognise(self, doc: Any) -> bool:
        return any(_sends_envelope(event) for event in documents(doc))

    def shared_rows(self, parsed: Any) -> Any:
        """Each choice's envelope by index: a stream's as assembled, a response's one for its
        one choice (refused when it has several: the merged ``nvext`` names no choice)."""
        if isinstance(parsed, Mapping) and _ROUTED in parsed:
            return parsed[_ROUTED]
        routes = _nvext_routes(parsed, f"{self.name} response")
        if routes is None:
            return {}
        choices = parsed.get("choices") if isinstance(parsed, Mapping) else None
        if isinstance(choices, list) and len(choices) != 1:
            raise WireFormatError(
                f"{self.name} {NVEXT}.{ROUTES_FIELD}: expected a response of one choice, found "
                f"{len(choices)}; Dynamo merges every choice's {NVEXT} into one (the last to "
                f"finish wins), so the routes name no choice: stream the request or send n = 1"
            )
        return {0: routes}

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}] {NVEXT}.{ROUTES_FIELD}"
        if not choice.wants(ROUTES_FIELD):
            return ChoiceRows(choice.index, ())
        envelope = choice.shared.get(choice.index)
        if envelope is None:
            return ChoiceRows(choice.index, (), (what,))
        if not isinstance(envelope, Mapping) or not all(k in envelope for k in ENVELOPE_KEYS):
            if isinstance(envelope, Mapping):
                found: object = list(envelope)[:8]
            else:  # a spliced body's string is a Blob
                found = "str" if isinstance(envelope, Blob) else type(envelope).__name__
            raise WireFormatError(
                f"{what}: expected {{{', '.join(ENVELOPE_KEYS)}}} (Dynamo's vLLM worker from PR "
                f"#10529), found {found}; earlier builds' base85 {{data, shape}} is not read"
            )
        # the worker sends int(start): a null one would read as position 0
        nonnegative_int(f"{what}.start", envelope["start"], WireFormatError)
        one_choice = len(choice.response["choices"]) == 1
        found = _lengths(choice.response, what) if one_choice else (None, None)
        prompt, completion = choice.placed(what, found)
        meta = self.rows_meta(choice, prompt, completion)
        return ChoiceRows(
            choice.index, (envelope_route_rows(envelope, prompt, completion, meta, what),)
        )

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/v1/chat/completions`` body of one choice, ``nvext`` last (the frontend's
        serde order), the envelope's keys sorted (serde_json's map). The dtype is vLLM's by
        the model's expert count (uint8 up to 256), else the smallest holding the ids."""
        top = (request.num_experts or int(request.routes.max(initial=0)) + 1) - 1
        routes = np.ascontiguousarray(request.routes.astype(compact_route_dtype(max(top, 0))))
        envelope = {
            "data": array_base64(routes),
            "dtype": routes.dtype.name,
            "shape": list(routes.shape),
            "start": request.start,
        }
        body = {
            "id": "chatcmpl-r3data-synth",
            "choices": [
                {
                    "index": 0,
                    "message": {"content": "", "role": "assistant"},
                    "finish_reason": "length",
                    "logprobs": None,
                }
            ],
            "created": 0,
            "model": "r3data-synth",
            "object": "chat.completion",
            "usage": openai_usage(request),
            NVEXT: {ROUTES_FIELD: envelope},
        }
        return orjson.dumps(body)


FORMAT = DynamoVllmFormat()
