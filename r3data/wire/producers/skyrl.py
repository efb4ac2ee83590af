"""SkyRL ``/skyrl/v1/generate``: route envelopes ``{"data", "shape", "dtype"}`` and the sampled
support.

What SkyRL's vLLM server actor returns (NovaSky-AI/SkyRL skyrl/backends/skyrl_train/
inference_servers/vllm_server_actor.py ``_skyrl_generate``, generate_wire.py
``pack_routed_experts``, utils/routed_experts.py ``compact_routed_expert_indices``), one
choice, serialised with orjson:

- ``choices[0].routed_experts`` (main 42f3d44b3-): an envelope, ``data`` first; ids in
  uint8 when all < 2**8, int16 when < 2**15, else int32 (from the ids present). Rows cover
  ``[start, prompt + completion - 1)``, ``start`` the request's
  ``routed_experts_prompt_start``: the envelope does not carry it. The body has no prompt
  ids: the prompt length is the request's.
- ``choices[0].rollout_sample_support`` (PR #2085/#2086, 790b4b071; not merged): int32
  ``[completion_tokens, top_k]``, each row the sampler's candidates then -1; row i is
  completion token i, at position ``prompt_len + i``. It becomes the ragged field
  ``rollout_sample_support`` (a row of length 0: no support recorded there).

Nested-list routes (before 42f3d44b3): :mod:`~r3data.wire.producers.skyrl_v1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from r3data.errors import ConfigError, PackedError, WireFormatError
from r3data.ragged import RaggedRows, first_bad_id
from r3data.wire.anchors import anchored_pos
from r3data.wire.dtypes import ROUTE_DTYPES
from r3data.wire.envelope import envelope_spec, unpack_ndarray
from r3data.wire.producers.base import (
    ROUTES_FIELD,
    Choice,
    ChoiceRows,
    EngineRequest,
    Lengths,
    ProducerFormat,
    StartOptions,
)
from r3data.wire.producers.common import (
    any_choice,
    array_base64,
    check_route_shape,
    envelope_rows,
    sources_of,
)
from r3data.wire.rows import InlineRows, RowSource

__all__ = ["FORMAT", "SUPPORT_FIELD", "SkyrlFormat", "skyrl_routes"]

SUPPORT_FIELD = "rollout_sample_support"


def skyrl_dtype(routes: np.ndarray) -> np.dtype:
    """SkyRL's compact ladder, from the ids present: uint8 < 2**8 <= int16 < 2**15 <= int32."""
    top = int(routes.max(initial=0))
    if top < 2**8:
        return np.dtype(np.uint8)
    return np.dtype(np.int16 if top < 2**15 else np.int32)


def skyrl_envelope(array: np.ndarray) -> dict[str, Any]:
    """``pack_ndarray``'s envelope: ``data``, ``shape``, ``dtype``."""
    array = np.ascontiguousarray(array)
    return {"data": array_base64(array), "shape": list(array.shape), "dtype": array.dtype.name}


def support_rows(
    envelope: object, prompt: int | None, completion: int | None, meta: dict[str, Any], what: str
) -> InlineRows:
    """The ragged rows of a ``rollout_sample_support`` envelope (int32, -1 padded)."""
    if prompt is None:
        raise WireFormatError(f"{what}: cannot place the support rows without the prompt length")
    padded, _ = unpack_ndarray(envelope, allowed_dtypes=("int32",), ndim=2, what=what)
    if completion is not None and padded.shape[0] != completion:
        raise WireFormatError(
            f"{what}: expected one row per completion token ({completion}), found "
            f"{padded.shape[0]} (first position {prompt})"
        )
    try:
        rows = RaggedRows.from_padded(padded, what=what)
    except PackedError as exc:
        raise WireFormatError(str(exc)) from None
    if first_bad_id(rows.values) is not None:  # int32: only a negative one
        raise WireFormatError(
            f"{what}: expected token ids >= 0 padded with -1, found {int(rows.values.min())}"
        )
    return InlineRows(SUPPORT_FIELD, rows, prompt, meta)


def _sends_skyrl(choice: Mapping[str, Any]) -> bool:
    """Whether a choice carries SkyRL's rows: a sampled support, or an envelope with ``dtype``
    and no ``start``."""
    routes = choice.get(ROUTES_FIELD)
    return isinstance(choice.get(SUPPORT_FIELD), Mapping) or (
        isinstance(routes, Mapping)
        and "dtype" in routes
        and "start" not in routes  # prime-rl's envelopes carry it
    )


class SkyrlFormat(ProducerFormat):
    name = "skyrl"
    producer = "SkyRL"
    versions = "main 42f3d44b3- ({data, shape, dtype}); PR #2085 790b4b071 rollout_sample_support"
    fields = (ROUTES_FIELD, SUPPORT_FIELD)
    options = StartOptions
    spliced = (ROUTES_FIELD, SUPPORT_FIELD)

    def recognise(self, doc: Any) -> bool:
        return any_choice(doc, _sends_skyrl)

    def route_rows(
        self,
        value: object,
        start: int,
        prompt: int | None,
        completion: int | None,
        meta: dict,
        what: str,
    ) -> RowSource:
        """The rows of ``routed_experts`` as this version sends them (an envelope)."""
        dtype, shape, _ = envelope_spec(value, allowed_dtypes=ROUTE_DTYPES, ndim=3, what=what)
        anchored_pos(shape[0], prompt, completion, start, what=what)
        rows = envelope_rows(value, ROUTES_FIELD, dtype, shape, pos=start, meta=meta, what=what)
        check_route_shape(rows, what)
        return rows

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}]"
        prompt, completion = choice.placed(what)
        meta = self.rows_meta(choice, prompt, completion)
        sources: list[Any] = []
        missing: list[str] = []
        if choice.wants(ROUTES_FIELD):
            value = choice.entry.get(ROUTES_FIELD)
            where = f"{what}.{ROUTES_FIELD}"
            if value is None:
                missing.append(where)
            else:
                start = self.start_of(choice.options)
                rows = self.route_rows(value, start, prompt, completion, meta, where)
                if rows.rows:  # none (a request from its last position): nothing to place
                    sources.append(rows)
        support = choice.entry.get(SUPPORT_FIELD)
        if choice.wants(SUPPORT_FIELD) and support is not None:
            where = f"{what}.{SUPPORT_FIELD}"
            sources.append(support_rows(support, prompt, completion, meta, where))
        return ChoiceRows(choice.index, tuple(sources), tuple(missing))

    def routes_value(self, routes: np.ndarray) -> Any:
        """``routed_experts`` as this version sends it."""
        return skyrl_envelope(routes.astype(skyrl_dtype(routes)))

    def encode(self, request: EngineRequest) -> bytes:
        """The ``/skyrl/v1/generate`` body (with ``rollout_sample_support`` for a mask)."""
        if request.routes.size and int(request.routes.max()) >= 2**31:
            raise ConfigError(f"{self.name} sends ids below 2**31")
        choice: dict[str, Any] = {
            "token_ids": [int(t) for t in request.completion_ids],
            "finish_reason": "length",
            "logprobs": None,
            ROUTES_FIELD: self.routes_value(request.routes),
        }
        if request.sampling_mask is not None:
            padded = request.sampling_mask.padded(max(request.sampling_mask.widest, 1))
            choice[SUPPORT_FIELD] = skyrl_envelope(padded.astype(np.int32))
        return orjson.dumps({"choices": [choice]})


FORMAT = SkyrlFormat()


def skyrl_routes(
    response: Any,
    *,
    pos: int | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
) -> list[RowSource]:
    """Routes of each choice of a SkyRL response: the ``"skyrl"`` format's route rows, from
    ``pos`` (the request's ``routed_experts_prompt_start``, which the body does not echo;
    default 0). A multi-turn SkyRL sends one on every turn after the first: give it, and the
    request's lengths, which check that the rows end at the last forwarded token (rows of a
    later turn read from 0 would otherwise be placed there silently)."""
    options = StartOptions(start=pos or 0)
    lengths = Lengths(prompt_len, completion_len)
    return sources_of(FORMAT.decode(response, options, lengths, frozenset({ROUTES_FIELD})))
