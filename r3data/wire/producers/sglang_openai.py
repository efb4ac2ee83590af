"""SGLang 0.5.12-0.5.23 OpenAI endpoints: the first sequence's routes in a response-level ``sglext``.

``/v1/chat/completions`` and ``/v1/completions`` with ``"return_routed_experts": true``
(sglang wheels: srt/entrypoints/openai/protocol.py ``SglExt``, a field of the responses and
their stream chunks, never of a choice; serving_chat.py ``_build_chat_response`` and
serving_completions.py ``_build_completion_response`` build it "from first ret_item";
serving_chat.py ``_generate_chat_stream``):

- ``sglext.routed_experts``: base64 of flat int32 ids, as on ``/generate``, for the **first
  sequence only**: with ``n > 1`` or several prompts the other choices' routes are not sent.
- Rows cover ``[start, prompt + completion - 1)``, ``start`` the request's
  ``routed_experts_start_len`` (forwarded from 0.5.12; 0.5.9-0.5.11: see
  :mod:`~r3data.wire.producers.sglang_openai_v059`). The sglext ids (``input_ids``,
  ``output_ids``, 0.5.23) give the lengths where sent, else ``usage`` when the response has
  one choice.
- A chat stream (and a completions stream: serving_completions.py
  ``_generate_completion_stream``) sends no routes with its content chunks, then one extra
  chunk with ``"choices": []`` and ``sglext.routed_experts``; with ``x-sglext-ids-framed: 1`` the
  sglext ids (``input_ids``, ``output_ids``) follow in a second such chunk (``event:
  sglext_ids``): the chunks' sglext fields are merged, each sent once.
- Chat with ``return_meta_info`` (0.5.23): no ``sglext.routed_experts``; each choice carries
  its own sequence's ``meta_info`` (``routed_experts``, ``prompt_tokens``,
  ``completion_tokens``, with ``return_sampling_mask`` its ``output_token_sampling_mask``),
  so every choice has its routes, ``n > 1`` included.
- Serving Kimi-K3, the chat endpoints report every prompt count 3 short of the model input
  (:data:`KIMI_K3_STUB_TOKENS`); the rows cover the whole input, and only routes that do
  (checked by their size) tell the stub from another response's shorter prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from r3data.errors import WireFormatError
from r3data.validate import nonnegative_int
from r3data.wire.anchors import anchored_pos, routes_end
from r3data.wire.producers.base import (
    MASK_FIELD,
    ROUTES_FIELD,
    Choice,
    ChoiceRows,
    EngineRequest,
    Lengths,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    INT32,
    any_choice,
    blob_nbytes,
    check_stream_choices,
    documents,
    openai_usage,
    parse_response,
    stream_events,
    token_counts,
)
from r3data.wire.producers.sglang import (
    SglangOptions,
    flat_int32_base64,
    flat_int32_rows,
    meta_info_rows,
)

__all__ = ["FORMAT", "SglangOpenaiFormat"]

EXT = "sglext"
KIMI_K3_STUB_TOKENS = 3
"""Kimi-K3's assistant generation stub: model input, so the rows cover it, but SGLang's chat
endpoints leave it out of every prompt count they report (serving_chat.py
``_KIMI_K3_GENERATION_STUB_TOKENS``, ``_reported_prompt_tokens``: ``usage.prompt_tokens``,
each choice's ``meta_info.prompt_tokens``, a stream's usage chunk)."""
_ROUTED_CHOICE = ("r3data", "sglext choice")
"""Key of an assembled stream (no JSON key can be it): the choice whose routes its
``sglext`` holds; a response's are choice 0's (SGLang's ``ret[0]``)."""


def _assemble(raw: Any, what: str) -> dict[Any, Any]:
    """One response from a chat stream: the choices seen, the one ``sglext`` and the usage.
    Its routes are the choice's that streamed first: SGLang keys them by choice in order of
    first output and sends the first (serving_chat.py ``_generate_chat_stream``)."""
    indices: dict[int, None] = {}  # in order of first appearance
    merged: dict[Any, Any] = {}
    for number, event in enumerate(stream_events(raw, what)):
        chunk = parse_response(event, (ROUTES_FIELD,))
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("choices"), list):
            raise WireFormatError(f"{what} event {number}: expected a chunk with a 'choices' list")
        for part in chunk["choices"]:
            index = part.get("index") if isinstance(part, Mapping) else None
            indices.setdefault(
                nonnegative_int(f"{what} event {number} index", index, WireFormatError)
            )
        ext = chunk.get(EXT)
        if ext is not None:
            if not isinstance(ext, Mapping):
                raise WireFormatError(
                    f"{what} event {number}: expected '{EXT}' to be an object, found "
                    f"{type(ext).__name__}"
                )
            into = merged.setdefault(EXT, {})
            for key, value in ext.items():
                if value is not None and into.get(key) is not None:
                    raise WireFormatError(
                        f"{what} event {number}: a second '{EXT}.{key}' (SGLang sends each "
                        f"sglext field once, after the content)"
                    )
                if value is not None:
                    into[key] = value
        if chunk.get("usage") is not None:
            merged["usage"] = chunk["usage"]
        if "object" in chunk:
            merged.setdefault("object", chunk["object"])
    count = max(1, check_stream_choices(indices, what))
    routed = next(iter(indices), 0)
    return {**merged, _ROUTED_CHOICE: routed, "choices": [{"index": i} for i in range(count)]}


def _choice_meta_info(choice: object) -> Mapping[str, Any] | None:
    """A choice's own ``meta_info`` (chat with ``return_meta_info``), else None."""
    meta_info = choice.get("meta_info") if isinstance(choice, Mapping) else None
    return meta_info if isinstance(meta_info, Mapping) else None


def _sends_meta_info_routes(choice: Mapping[str, Any]) -> bool:
    meta_info = _choice_meta_info(choice)
    return meta_info is not None and isinstance(meta_info.get(ROUTES_FIELD), str)


def _ext_lengths(response: Mapping[str, Any], index: int) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` of choice ``index`` from the sglext ids
    (``return_input_ids_in_sglext``: the prompt's ids; ``return_output_ids_in_sglext``: each
    choice's output ids), where sent."""
    ext = response.get(EXT)
    if not isinstance(ext, Mapping):
        return None, None
    prompt, outputs = ext.get("input_ids"), ext.get("output_ids")
    what = f"{EXT}.output_ids"
    if outputs is not None and type(outputs) is not list:
        raise WireFormatError(
            f"{what}: expected a list of token-id lists (one per choice), found "
            f"{type(outputs).__name__}"
        )
    if outputs is not None and index >= len(outputs):
        raise WireFormatError(
            f"{what}: expected the ids of choice {index} (one list per choice), found "
            f"{len(outputs)} lists"
        )
    output = None if outputs is None else outputs[index]
    return _ids_length(prompt, f"{EXT}.input_ids"), _ids_length(output, f"{what}[{index}]")


def _reported(
    response: Mapping[str, Any],
    counts: tuple[int | None, int | None],
    lengths: Lengths,
    routes: object,
    options: SglangOptions,
    start: int,
    what: str,
) -> tuple[int | None, int | None]:
    """The ``(prompt_tokens, completion_tokens)`` a response reports, as counts of the model
    input: a chat response's prompt count :data:`KIMI_K3_STUB_TOKENS` short of the request's
    is the request's (Kimi-K3's stub, which SGLang does not report) where its ``routes`` (the
    flat ids it carries, decoded or not; ``options`` shape them) cover the request's whole
    input from ``start``; routes of another size are refused (another request's response, whose
    prompt is 3 shorter), and any other difference, or no routes to tell by, stays one for
    :func:`~.common.placed_lengths` to refuse."""
    prompt, completion = counts
    chat = str(response.get("object", "")).startswith("chat.completion")
    if not (chat and prompt is not None and prompt + KIMI_K3_STUB_TOKENS == lengths.prompt_len):
        return prompt, completion
    sampled = lengths.completion_len if completion is None else completion
    rows = None if sampled is None else routes_end(lengths.prompt_len, sampled) - start
    if routes is None or rows is None or rows < 0:  # nothing to tell by (a bad start: refused)
        return prompt, completion
    per_row = options.num_layers * options.topk * INT32.itemsize
    nbytes = blob_nbytes(routes, what)
    if nbytes != rows * per_row:
        raise WireFormatError(
            f"{what}: the response has {prompt} prompt tokens, the request {lengths.prompt_len} "
            f"(Kimi-K3's {KIMI_K3_STUB_TOKENS}-token stub left out?), but its routes are not "
            f"the whole input's: expected {rows} rows (prompt {lengths.prompt_len} + completion "
            f"{sampled} - 1 - start {start}) of {per_row} bytes, found {nbytes} bytes; "
            f"is this the request's response?"
        )
    return lengths.prompt_len, completion


def _ids_length(ids: object, what: str) -> int | None:
    """How many token ids ``ids`` (a list, or None: not sent) holds."""
    if ids is not None and type(ids) is not list:
        raise WireFormatError(f"{what}: expected a list of token ids, found {type(ids).__name__}")
    return None if ids is None else len(ids)


def _ext_routes(doc: object) -> object:
    """The routes in a response's (or chunk's) ``sglext``, else None."""
    ext = doc.get(EXT) if isinstance(doc, Mapping) else None
    return ext.get(ROUTES_FIELD) if isinstance(ext, Mapping) else None


class SglangOpenaiFormat(ProducerFormat):
    name = "sglang-openai"
    producer = "SGLang"
    versions = "0.5.12-0.5.23 (OpenAI chat and completions: response-level sglext; chat stream)"
    fields = (ROUTES_FIELD, MASK_FIELD)
    options = SglangOptions
    spliced = (ROUTES_FIELD,)
    stream_assembler = staticmethod(_assemble)

    def recognise(self, doc: Any) -> bool:
        return any(
            isinstance(_ext_routes(event), str) or any_choice(event, _sends_meta_info_routes)
            for event in documents(doc)
        )

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        meta_info = _choice_meta_info(choice.entry)
        if meta_info is not None:
            where = f"{self.name} choices[{choice.index}].meta_info"
            counts = token_counts(meta_info, f"{where}.{ROUTES_FIELD}: ")
            routes, start = meta_info.get(ROUTES_FIELD), self.start_of(choice.options)
            what = f"{where}.{ROUTES_FIELD}"
            counts = _reported(
                choice.response, counts, choice.lengths, routes, choice.options, start, what
            )
            return meta_info_rows(self, choice, meta_info, where, counts)
        what = f"{self.name} {EXT}.{ROUTES_FIELD}"
        if not choice.wants(ROUTES_FIELD):  # sglext holds routes only
            return ChoiceRows(choice.index, ())
        if choice.index != choice.response.get(_ROUTED_CHOICE, 0):
            first_only = f"{what} for choice {choice.index} (first sequence only)"
            return ChoiceRows(choice.index, (), (first_only,))
        found = _ext_lengths(choice.response, choice.index)
        usage = choice.response.get("usage")
        one_choice = len(choice.response["choices"]) == 1
        value, start = _ext_routes(choice.response), self.start_of(choice.options)
        if found == (None, None) and isinstance(usage, Mapping) and one_choice:
            reported = token_counts(usage, "usage.")
            found = _reported(
                choice.response, reported, choice.lengths, value, choice.options, start, what
            )
        if value is None:
            return ChoiceRows(choice.index, (), (what,))
        prompt, completion = choice.placed(what, found)
        meta = self.rows_meta(choice, prompt, completion)
        rows = flat_int32_rows(value, choice.options, start, meta, what)
        anchored_pos(rows.rows, prompt, completion, start, what=what)
        return ChoiceRows(choice.index, (rows,))

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/v1/chat/completions`` body for one sample (field order as SGLang's)."""
        self.check_start(request)
        body = {
            "id": "r3data-synth",
            "object": "chat.completion",
            "created": 0,
            "model": "r3data-synth",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "", "tool_calls": None},
                    "logprobs": None,
                    "finish_reason": "length",
                    "matched_stop": None,
                }
            ],
            "usage": openai_usage(request),
            "metadata": {"weight_version": "default"},
            EXT: {ROUTES_FIELD: flat_int32_base64(request.routes)},
        }
        return orjson.dumps(body)


FORMAT = SglangOpenaiFormat()
