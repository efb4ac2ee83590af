"""prime-rl ``/inference/v1/generate``: route envelopes, kept-token masks, by-handle segments.

prime-rl serves vLLM's tokens endpoint with its own route encoding (PrimeIntellect-ai/prime-rl
src/prime_rl/inference/vllm/routed_experts.py ``serialize_routed_experts``, serving_tokens.py;
readers: verifiers v1/graph.py ``_attribute_routed_experts`` / ``_attribute_kept_tokens``):

- ``choices[i].routed_experts``: ``{"data": base64, "shape": [rows, layers, topk], "start",
  "dtype"}``, ``data`` first. Versions read with the later fields' defaults, as verifiers
  reads them: v1 (1e0fe9637) ``{data, shape}``; v2 (ae748fd69) adds ``start``; v3
  (6b1604380, current) adds ``dtype``, uint8 or, when an id of *this* response exceeds 255,
  uint16. Without ``dtype`` the ids are uint8; without ``start`` the rows start at 0. Rows
  cover ``[start, start + rows)``, ``start`` the request's ``routed_experts_prompt_start``.
- ``choices[i].kept_tokens`` (branch feat/sampling-replay d09488d57, kept_tokens.py
  ``serialize_kept_tokens``): ``{"ids": base64, "counts": base64}``, bare little-endian
  int32 (no envelopes); ``counts[i]`` is the size of completion token i's kept set, at
  position ``prompt_len + i``; a count of 0 means no mask at that token (the full vocabulary:
  greedy, not truncated, or wider than 512), and the field is null when every count is 0.
  They become ``sampling_mask`` rows: a row of length 0 is "no mask", never an empty set.
- ``choices[i].sampling_mask``: vLLM's native mask passed through by prime-rl's tokens
  endpoint (read so by PrimeIntellect's renderers 0.1.12 client.py ``generate``): one list of
  kept ids per completion token, row i at ``prompt_len + i``.
- Under prefill/decode disaggregation PrimeIntellect-ai/router (src/routers/http/
  routed_experts_merge.rs at 02403201136d) merges the prefill's rows into each decode choice:
  inline, an envelope ``{data, shape, start}`` (uint8, no dtype); by handle, ``choices[i].
  payload = [{field, file, offset, pos, rows, dtype, shape}, ...]`` (prefill segments first,
  the decode's clipped after them). Both are read as any other response (role ``full``).
  By-handle sampling masks are int32 ``[tokens, widest]`` rows padded with -1 (r3data's
  contract: no public writer), mask row i at ``prompt_len + i``.

The response carries no prompt ids: the prompt length is the request's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from r3data.errors import ConfigError, R3DataError, WireFormatError, with_message
from r3data.ragged import RaggedRows
from r3data.wire.anchors import anchored_pos
from r3data.wire.dtypes import ROUTE_DTYPES
from r3data.wire.envelope import check_nbytes, envelope_spec
from r3data.wire.masks import check_csr
from r3data.wire.producers.base import (
    MASK_FIELD,
    ROUTES_FIELD,
    Choice,
    ChoiceOptions,
    ChoiceRows,
    EngineRequest,
    Lengths,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    any_choice,
    array_base64,
    blob_nbytes,
    blob_rows,
    check_route_shape,
    envelope_rows,
    int32_blob,
    kept_id_rows,
    optional_position,
    sources_of,
)
from r3data.wire.rows import InlineRows, RowSource
from r3data.wire.segment import PayloadSegment

__all__ = ["FORMAT", "PrimeRlFormat", "kept_tokens_rows", "primerl_routes"]

KEPT_TOKENS = "kept_tokens"
PAYLOAD = "payload"
SPLICED = ("data", "ids", "counts")
"""The blobs' own keys: spliced on them, so envelopes without a dtype (v1, v2, the router's
merge) and kept_tokens' bare blobs splice too; prime-rl's bodies use these keys nowhere else."""


def kept_tokens_rows(
    value: object, prompt: int | None, completion: int | None, meta: dict[str, Any], what: str
) -> InlineRows:
    """``sampling_mask`` rows of a ``kept_tokens`` value (null: no mask at any token)."""
    if prompt is None:
        raise WireFormatError(f"{what}: cannot place the mask rows without the prompt length")
    if value is None:
        if completion is None:
            raise WireFormatError(
                f"{what}: null (no mask at any token) but the completion length is unknown"
            )
        empty = RaggedRows(np.empty(0, np.int32), np.zeros(completion + 1, np.int64))
        return InlineRows(MASK_FIELD, empty, prompt, meta)
    if not isinstance(value, Mapping) or "ids" not in value or "counts" not in value:
        found = sorted(value)[:8] if isinstance(value, Mapping) else type(value).__name__
        raise WireFormatError(
            f"{what}: expected {{'ids': base64, 'counts': base64}}, found {found}"
        )
    ids, counts = check_csr(
        int32_blob(value["ids"], f"{what}.ids"),
        int32_blob(value["counts"], f"{what}.counts"),
        what=what,
    )
    if completion is not None and counts.size != completion:
        raise WireFormatError(
            f"{what}: expected one kept-set size per completion token ({completion}), found "
            f"{counts.size} (first position {prompt})"
        )
    return InlineRows(MASK_FIELD, RaggedRows.from_lengths(ids, counts, what=what), prompt, meta)


def envelope_route_rows(
    envelope: object, prompt: int | None, completion: int | None, meta: dict[str, Any], what: str
) -> RowSource:
    """The route rows of a ``{data, shape, start, dtype}`` envelope (prime-rl's, which Dynamo's
    vLLM worker writes too), anchored at its ``start`` and checked against the lengths."""
    if not isinstance(envelope, Mapping):
        raise WireFormatError(
            f"{what}: expected an envelope {{data, shape, start, dtype}}, found "
            f"{type(envelope).__name__}"
        )
    spec = envelope if "dtype" in envelope else {**envelope, "dtype": "uint8"}  # before v3
    dtype, shape, sidecar = envelope_spec(spec, allowed_dtypes=ROUTE_DTYPES, ndim=3, what=what)
    start = optional_position(sidecar.get("start"), f"{what}.start", WireFormatError) or 0
    anchored_pos(shape[0], prompt, completion, start, what=what)
    data = envelope["data"]
    if isinstance(data, np.ndarray):  # an envelope load_packed_body decoded
        rows = envelope_rows(envelope, ROUTES_FIELD, dtype, shape, pos=start, meta=meta, what=what)
    else:  # spliced on "data": a bare blob, encoded or decoded
        check_nbytes(blob_nbytes(data, f"{what}.data"), dtype, shape, what=f"{what}.data")
        rows = blob_rows(
            ROUTES_FIELD, data, dtype=dtype, shape=shape, pos=start, meta=meta, what=what
        )
    check_route_shape(rows, what)
    return rows


def _segments(
    value: object, wanted: frozenset[str] | None, role: str, what: str
) -> list[PayloadSegment]:
    if not isinstance(value, list):
        raise WireFormatError(f"{what}: expected a list of segments, found {type(value).__name__}")
    if role == "decode":
        raise ConfigError(
            f"{what}: role 'decode' applies to inline rows; by handle, the router sends a P/D "
            f"response merged (prefill segments first): read it with role 'full'"
        )
    out = []
    for number, entry in enumerate(value):
        try:
            segment = PayloadSegment.from_dict(entry)
        except R3DataError as exc:
            raise with_message(exc, f"{what}[{number}]: {exc}") from None
        if wanted is None or segment.field in wanted:
            out.append(segment)
    return out


def _sends_primerl(choice: Mapping[str, Any]) -> bool:
    """Whether a choice carries prime-rl's rows: an envelope with ``start`` or without
    ``dtype``, by-handle segments or kept tokens."""
    routes = choice.get(ROUTES_FIELD)
    return (
        (
            isinstance(routes, Mapping)
            and "data" in routes
            and ("start" in routes or "dtype" not in routes)  # SkyRL sends neither form
        )
        or isinstance(choice.get(PAYLOAD), list)
        or isinstance(choice.get(KEPT_TOKENS), Mapping)
    )


def _primerl_dtype(routes: np.ndarray) -> np.dtype:
    """uint8, or uint16 when an id exceeds 255 (prime-rl picks it from the ids present)."""
    top = int(routes.max(initial=0))
    if top > np.iinfo(np.uint16).max:
        raise ConfigError(f"prime-rl sends ids up to 65535 (uint16), found {top}")
    return np.dtype(np.uint8 if top <= 255 else np.uint16)


class PrimeRlFormat(ProducerFormat):
    name = "prime-rl"
    producer = "prime-rl"
    versions = (
        "main 1e0fe9637 {data, shape}, ae748fd69 +start, 6b1604380- +dtype; branch "
        "feat/sampling-replay d09488d57 kept_tokens; PrimeIntellect-ai/router 02403201136d "
        "P/D merges (inline, by handle)"
    )
    fields = (ROUTES_FIELD, MASK_FIELD)
    options = ChoiceOptions
    spliced = SPLICED

    def recognise(self, doc: Any) -> bool:
        return any_choice(doc, _sends_primerl)

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}]"
        prompt, completion = choice.placed(what)
        meta = self.rows_meta(choice, prompt, completion)
        entry = choice.entry
        sources: list[Any] = []
        missing: list[str] = []
        if entry.get(PAYLOAD) is not None:
            role = choice.options.role
            sources += _segments(entry[PAYLOAD], choice.fields, role, f"{what}.{PAYLOAD}")
        if choice.wants(ROUTES_FIELD):
            routes = entry.get(ROUTES_FIELD)
            if routes is not None:
                sources.append(
                    envelope_route_rows(routes, prompt, completion, meta, f"{what}.{ROUTES_FIELD}")
                )
            elif not any(s.field == ROUTES_FIELD for s in sources):
                missing.append(f"{what}.{ROUTES_FIELD}")
        native = entry.get(MASK_FIELD)
        if choice.wants(MASK_FIELD) and native is not None:
            if entry.get(KEPT_TOKENS) is not None:
                raise WireFormatError(
                    f"{what}: expected one mask, found both {KEPT_TOKENS!r} and {MASK_FIELD!r}"
                )
            where = f"{what}.{MASK_FIELD}"
            sources.append(kept_id_rows(MASK_FIELD, native, prompt, completion, meta, where))
        elif choice.wants(MASK_FIELD) and KEPT_TOKENS in entry:
            sources.append(
                kept_tokens_rows(
                    entry[KEPT_TOKENS], prompt, completion, meta, f"{what}.{KEPT_TOKENS}"
                )
            )
        return ChoiceRows(choice.index, tuple(sources), tuple(missing))

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/inference/v1/generate`` body (v3 envelope; ``kept_tokens`` with a mask)."""
        routes = np.ascontiguousarray(request.routes.astype(_primerl_dtype(request.routes)))
        envelope = {
            "data": array_base64(routes),
            "shape": list(routes.shape),
            "start": request.start,
            "dtype": routes.dtype.name,
        }
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [int(t) for t in request.completion_ids],
            ROUTES_FIELD: envelope,
        }
        mask = request.sampling_mask
        if mask is not None:
            values, offsets = mask.compact()
            counts = np.diff(offsets).astype(np.int32)
            kept = {"ids": array_base64(values.astype(np.int32)), "counts": array_base64(counts)}
            choice[KEPT_TOKENS] = kept if counts.any() else None
        body = {
            "request_id": "r3data-synth",
            "model": "r3data-synth",
            "choices": [choice],
            "usage": {
                "prompt_tokens": request.prompt_len,
                "completion_tokens": request.completion_len,
            },
        }
        return orjson.dumps(body)


FORMAT = PrimeRlFormat()


def primerl_routes(
    response: Any,
    *,
    choice: int | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
) -> list[RowSource]:
    """Inline routes of each choice (or of ``choice``) of a prime-rl response: the
    ``"prime-rl"`` format's route rows; ``prompt_len`` / ``completion_len`` are the request's
    (they check the row count)."""
    lengths = Lengths(prompt_len, completion_len)
    found = FORMAT.decode(
        response, ChoiceOptions(choice=choice), lengths, frozenset({ROUTES_FIELD})
    )
    rows = sources_of(found)
    if not all(isinstance(s, RowSource) for s in rows):
        raise WireFormatError(
            "prime-rl response: rows travel by handle ('payload' segments); read them with "
            "r3data.payload, or give the response to the loader"
        )
    return rows
