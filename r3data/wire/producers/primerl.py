"""prime-rl: inline route envelopes and CSR sampling masks per choice.

The format (DESIGN.md, "Facts the formats must honour"):

- routes inline: ``choices[i].routed_experts = {"data": base64, "shape": [rows, layers,
  topk], "start": int, "dtype": "uint8" | "uint16"}``. Routes are anchored at the end: they
  cover ``[prompt_len + completion_len - 1 - rows, prompt_len + completion_len - 1)``, and
  ``start`` names the first of those positions.
- sampling masks: ``choices[i].sampling_mask = {"ids": <int32 envelope>, "counts": <int32
  envelope>}``; ``counts[i]`` is the kept-set size of completion token i, whose position is
  ``prompt_len + i``; they stay ragged (:class:`~r3data.ragged.RaggedRows`).
- by handle, a choice carries ``payload: [segment, ...]`` instead; those are read by
  :mod:`r3data.payload`, not here.

Parse a raw body once for both fields with ``load_packed_body(raw, ("routed_experts",
"sampling_mask"))`` and pass the result to both functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r3data.errors import ConfigError, WireFormatError
from r3data.ragged import RaggedRows
from r3data.wire.anchors import anchored_pos
from r3data.wire.dtypes import ROUTE_DTYPES
from r3data.wire.envelope import envelope_spec
from r3data.wire.masks import unpack_csr
from r3data.wire.producers.common import (
    check_route_shape,
    choice_token_lengths,
    envelope_rows,
    optional_position,
    parse_response,
    select_choices,
)
from r3data.wire.rows import InlineRows, RowSource

__all__ = ["primerl_routes", "primerl_sampling_mask"]


def _lengths(
    parsed: Mapping[str, Any],
    entry: Mapping[str, Any],
    prompt_len: int | None,
    completion_len: int | None,
) -> tuple[int | None, int | None]:
    found_prompt, found_completion = choice_token_lengths(parsed, entry)
    return (
        found_prompt if prompt_len is None else prompt_len,
        found_completion if completion_len is None else completion_len,
    )


def _field_value(entry: Mapping[str, Any], field: str, what: str) -> Any:
    value = entry.get(field)
    if value is None and entry.get("payload") is not None:
        raise WireFormatError(
            f"{what}: rows travel by handle ('payload' segments); read them with r3data.payload"
        )
    if value is None:
        raise WireFormatError(f"{what}: missing (null or absent)")
    return value


def primerl_routes(
    response: Any,
    *,
    choice: int | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    field: str = "routed_experts",
) -> list[RowSource]:
    """Inline routes of each choice (or of ``choice``) of a prime-rl response.

    Positions come from the end anchor when the prompt and completion lengths are known
    (arguments, else the choice's token id lists); the envelope's ``start`` must then agree.
    Without them, ``start`` alone places the rows.
    """
    prompt_arg = optional_position(prompt_len, "prompt_len", ConfigError)
    completion_arg = optional_position(completion_len, "completion_len", ConfigError)
    parsed = parse_response(response, (field,))
    out = []
    for index, entry in select_choices(parsed, choice, "prime-rl response"):
        what = f"prime-rl choices[{index}].{field}"
        envelope = _field_value(entry, field, what)
        dtype, shape, sidecar = envelope_spec(
            envelope, allowed_dtypes=ROUTE_DTYPES, ndim=3, what=what
        )
        start = optional_position(sidecar.get("start"), f"{what}.start", WireFormatError)
        prompt, completion = _lengths(parsed, entry, prompt_arg, completion_arg)
        pos = anchored_pos(shape[0], prompt, completion, start, what=what)
        if pos is None:
            raise WireFormatError(
                f"{what}: cannot place the rows: no 'start' and no prompt/completion lengths"
            )
        meta = {
            "producer": "prime-rl",
            "choice": index,
            "prompt_len": prompt,
            "completion_len": completion,
        }
        rows = envelope_rows(envelope, field, dtype, shape, pos=pos, meta=meta, what=what)
        check_route_shape(rows, what)
        out.append(rows)
    return out


def primerl_sampling_mask(
    response: Any,
    *,
    choice: int | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    field: str = "sampling_mask",
) -> list[InlineRows]:
    """Sampling masks of each choice (or of ``choice``) as ragged rows (CSR).

    Row i is completion token i at position ``prompt_len + i``; the prompt length is
    required (argument, else the token id lists). ``meta["widest"]`` is the largest set.
    """
    prompt_arg = optional_position(prompt_len, "prompt_len", ConfigError)
    completion_arg = optional_position(completion_len, "completion_len", ConfigError)
    parsed = parse_response(response, (field,))
    out = []
    for index, entry in select_choices(parsed, choice, "prime-rl response"):
        what = f"prime-rl choices[{index}].{field}"
        ids, counts = unpack_csr(_field_value(entry, field, what), what=what)
        prompt, completion = _lengths(parsed, entry, prompt_arg, completion_arg)
        if prompt is None:
            raise WireFormatError(f"{what}: cannot place the mask rows without the prompt length")
        if completion is not None and counts.size != completion:
            raise WireFormatError(
                f"{what}: expected one kept-set size per completion token ({completion}), "
                f"found {counts.size}"
            )
        mask = RaggedRows.from_lengths(ids, counts, what=what)
        meta = {
            "producer": "prime-rl",
            "choice": index,
            "prompt_len": prompt,
            "completion_len": counts.size,
            "widest": mask.widest,
        }
        out.append(InlineRows(field, mask, prompt, meta))
    return out
