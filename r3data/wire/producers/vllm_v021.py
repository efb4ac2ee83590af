"""vLLM 0.21.0: the split format, prompt rows at the response level, generated rows per choice.

What vLLM 0.21.0 returns with ``--enable-return-routed-experts`` (vllm 0.21.0 wheel:
model_executor/layers/fused_moe/routed_experts_capturer.py ``split_routed_experts``,
v1/engine/output_processor.py ``make_request_output``, entrypoints/openai/completion/
serving.py ``request_output_to_completion_response``, chat_completion/serving.py
``chat_completion_full_generator``):

- ``prompt_routed_experts`` (top level): the rows of positions ``[0, prompt_len)``, nested
  JSON lists of int16 ids, ``[prompt_len, num_moe_layers, topk]``: **MoE layers only**, in
  FusedMoE construction order (the layer axis is "moe", not every decoder layer). Taken from
  the first prompt only (completions with several prompts send the others' nowhere); rows of
  prefix-cached positions are all zero (the screen finds them missing).
- ``choices[i].routed_experts``: the choice's generated rows ``[prompt_len, prompt_len +
  completion_len - 1)``, ``completion_len - 1`` rows (``completion_len`` with MTP), same
  lists; null when there are none (one completion token, a preempted request).
- No ``routed_experts_prompt_start``: rows always start at 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from r3data.errors import EngineRoutesError, WireFormatError
from r3data.wire.producers.base import (
    ROUTES_FIELD,
    Choice,
    ChoiceOptions,
    ChoiceRows,
    EngineRequest,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    choice_token_lengths,
    nested_rows,
    select_choices,
)
from r3data.wire.producers.vllm import completion_choice
from r3data.wire.rows import InlineRows

__all__ = ["FORMAT", "Vllm021Format"]

PROMPT_FIELD = "prompt_routed_experts"


def _shares_first_prompt(parsed: Mapping[str, Any], index: int, entry: Mapping[str, Any]) -> bool:
    """Whether choice ``index`` answers the first prompt, whose rows ``prompt_routed_experts``
    holds: every chat choice (one prompt), completions with the prompt ids of choice 0 (by its
    ``index``: a body may list its choices in any order)."""
    if index == 0 or parsed.get("object") == "chat.completion":
        return True
    _, first = select_choices(parsed, 0, f"{Vllm021Format.name} choices")[0]
    ids = entry.get("prompt_token_ids")
    return isinstance(ids, list) and ids == first.get("prompt_token_ids")


class Vllm021Format(ProducerFormat):
    name = "vllm-0.21"
    producer = "vLLM"
    versions = "0.21.0 (split: prompt_routed_experts + per-choice routed_experts, int16 lists)"
    options = ChoiceOptions
    layer_axis = "moe"
    prompt_start = False
    current = False

    def recognise(self, doc: Any) -> bool:
        return (
            isinstance(doc, Mapping)
            and PROMPT_FIELD in doc
            and isinstance(doc.get("choices"), list)
        )

    def shared_rows(self, parsed: Any) -> np.ndarray | None:
        """The first prompt's rows (``prompt_routed_experts``)."""
        if parsed.get(PROMPT_FIELD) is None:
            return None
        return nested_rows(parsed[PROMPT_FIELD], 3, f"{self.name} {PROMPT_FIELD}")

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        index, entry, prompt_rows = choice.index, choice.entry, choice.shared
        what = f"{self.name} choices[{index}].{ROUTES_FIELD}"
        found = choice_token_lengths(choice.response, entry)
        shared = prompt_rows is not None and _shares_first_prompt(choice.response, index, entry)
        if shared and found[0] is None and choice.lengths.prompt_len is None:
            found = (prompt_rows.shape[0], found[1])
        prompt, completion = choice.placed(what, found)
        meta = self.rows_meta(choice, prompt, completion)
        sources: list[InlineRows] = []
        missing: list[str] = []
        if shared:
            if prompt is not None and prompt_rows.shape[0] != prompt:
                raise EngineRoutesError(
                    f"{self.name} {PROMPT_FIELD}: expected {prompt} rows (one per prompt token "
                    f"of choice {index}), found {prompt_rows.shape[0]}"
                )
            sources.append(InlineRows(ROUTES_FIELD, prompt_rows, 0, meta))
        else:
            missing.append(f"{self.name} {PROMPT_FIELD} (for choice {index})")
        value = entry.get(ROUTES_FIELD)
        if value is not None:
            generated = nested_rows(value, 3, what)
            if prompt is None:
                raise WireFormatError(
                    f"{what}: cannot place the generated rows without the prompt length "
                    f"(request return_token_ids, or give the request's lengths)"
                )
            if completion is not None and generated.shape[0] > completion:
                raise EngineRoutesError(
                    f"{what}: expected at most {completion} generated rows (completion "
                    f"{completion} - 1, or {completion} with MTP), found {generated.shape[0]}"
                )
            if sources and generated.shape[1:] != prompt_rows.shape[1:]:
                raise WireFormatError(
                    f"{what}: rows of {list(generated.shape[1:])}, but "
                    f"{PROMPT_FIELD} has rows of {list(prompt_rows.shape[1:])}"
                )
            sources.append(InlineRows(ROUTES_FIELD, generated, prompt, meta))
        elif completion != 1:
            missing.append(what)
        return ChoiceRows(index, tuple(sources), tuple(missing))

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/v1/completions`` body as 0.21.0 sends it (rows from 0, MoE layers only)."""
        self.check_start(request)
        layers = request.moe_layers or range(request.routes.shape[1])
        full = request.routes[:, list(layers)].astype(np.int16)
        prompt, generated = full[: request.prompt_len], full[request.prompt_len :]
        choice = completion_choice(request, generated.tolist() if generated.size else None)
        body = {
            "object": "text_completion",
            PROMPT_FIELD: prompt.tolist() if prompt.size else None,
            "model": "r3data-synth",
            "choices": [choice],
        }
        return orjson.dumps(body)


FORMAT = Vllm021Format()
