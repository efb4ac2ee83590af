"""SGLang 0.5.12-0.5.23 ``/generate``: routed experts as base64 of flat int32 ids in ``meta_info``.

What SGLang returns with ``--enable-return-routed-experts`` and ``"return_routed_experts":
true`` (sglang wheels: srt/state_capturer/base.py ``BaseTopkCapturer.get_topk``,
managers/scheduler_components/batch_result_processor.py ``_maybe_collect_routed_experts``,
managers/detokenizer_manager.py ``_b64_encode_per_request``, managers/tokenizer_manager.py):

- ``meta_info.routed_experts``: base64 of the flat little-endian int32 ids, shaped ``(-1,
  num_hidden_layers, num_experts_per_tok)`` by the model config (the body has no shape);
  absent when the request has none. ``meta_info.prompt_tokens`` / ``completion_tokens``.
- ``meta_info.output_token_sampling_mask`` (0.5.16+, ``return_sampling_mask``): per output
  token the list of ids the sampler kept (greedy: the sampled one), row i at ``prompt + i``;
  it becomes ``sampling_mask`` rows.
- Rows cover ``[start, prompt + completion - 1)``, ``start`` the request's
  ``routed_experts_start_len`` (honoured from 0.5.12; not echoed).
- A batched request (several prompts, ``n > 1``) returns a list of such items, each its own.
- A stream sends the routes in the final chunk only (they are gathered when the request
  finishes): the final chunk is the whole response, but for the sampling mask under
  ``--incremental-streaming-output``, where each chunk holds its delta's rows (joined over
  the item's chunks). A batch's stream interleaves its items' chunks, each tagged
  ``"index"`` (tokenizer_manager.py ``_stream_batch_responses``): each item's last chunk is
  that item.

0.5.7-0.5.11 ignore the start: :mod:`~r3data.wire.producers.sglang_v057`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from r3data.errors import ConfigError, WireFormatError
from r3data.ragged import RaggedRows
from r3data.validate import nonnegative_int
from r3data.wire.anchors import anchored_pos
from r3data.wire.masks import check_csr
from r3data.wire.producers.base import (
    MASK_FIELD,
    ROUTES_FIELD,
    Choice,
    ChoiceRows,
    EngineRequest,
    ProducerFormat,
    ShapeOptions,
    StartOptions,
)
from r3data.wire.producers.common import (
    INT32,
    array_base64,
    blob_nbytes,
    blob_rows,
    check_stream_choices,
    documents,
    int32_blob,
    kept_id_rows,
    parse_response,
    sources_of,
    stream_events,
    token_counts,
)
from r3data.wire.rows import InlineRows, RowSource

__all__ = [
    "FORMAT",
    "TOP_P_KEYS",
    "SglangFormat",
    "SglangOptions",
    "flat_int32_base64",
    "flat_int32_rows",
    "meta_info_of",
    "meta_info_rows",
    "sglang_routes",
    "top_p_rows",
]

SAMPLING_MASK = "output_token_sampling_mask"
"""Per output token the ids the sampler kept (``return_sampling_mask``). Over a stream it is
cumulative, or under ``--incremental-streaming-output`` each chunk's delta; its
``output_token_sampling_mask_length`` counts them all either way."""
MASK_LENGTH = f"{SAMPLING_MASK}_length"
TOP_P_KEYS = (
    ("top_p_token_ids", "top_p_token_offsets"),
    ("top_p_kept_token_ids", "top_p_kept_token_offsets"),
)
"""slime's patched SGLang's masks (:mod:`~r3data.wire.producers.slime`), current names first."""


@dataclass(frozen=True, kw_only=True)
class SglangOptions(ShapeOptions, StartOptions):
    """``num_layers``, ``topk`` (the model config's), ``start`` (``routed_experts_start_len``),
    ``choice`` (the item of a batch list), ``role``."""


def flat_int32_rows(
    value: object, options: ShapeOptions, start: int, meta: dict[str, Any], what: str
) -> RowSource:
    """Rows of ``num_layers x topk`` int32 ids from a bare base64 blob of flat ids."""
    per_row = options.num_layers * options.topk
    nbytes = blob_nbytes(value, what)
    if nbytes % (per_row * INT32.itemsize):
        raise WireFormatError(
            f"{what}: expected a multiple of {per_row} int32 ids (layers {options.num_layers} x "
            f"topk {options.topk}), found {nbytes} bytes"
        )
    shape = (nbytes // (per_row * INT32.itemsize), options.num_layers, options.topk)
    return blob_rows(ROUTES_FIELD, value, dtype=INT32, shape=shape, pos=start, meta=meta, what=what)


def meta_info_rows(
    entry: ProducerFormat,
    choice: Choice,
    meta_info: Mapping[str, Any],
    where: str,
    counts: tuple[int | None, int | None] | None = None,
    reads_top_p: bool = False,
) -> ChoiceRows:
    """The rows in one sequence's ``meta_info`` (``where`` names it): its routes, and with
    ``return_sampling_mask`` its ``output_token_sampling_mask`` (``reads_top_p``: slime's
    top-p masks instead, :func:`top_p_rows`; a format that does not read them refuses them
    rather than drop them); ``prompt_tokens`` and ``completion_tokens`` (or ``counts``, what
    the caller made of them) place and check them."""
    what = f"{where}.{ROUTES_FIELD}"
    if counts is None:
        counts = token_counts(meta_info, f"{what}: ")
    prompt, completion = choice.placed(what, counts)
    meta = entry.rows_meta(choice, prompt, completion)
    sources: list[RowSource] = []
    missing: tuple[str, ...] = ()
    value = meta_info.get(ROUTES_FIELD)
    if choice.wants(ROUTES_FIELD) and value is None:
        missing = (what,)
    elif choice.wants(ROUTES_FIELD):
        start = entry.start_of(choice.options)
        rows = flat_int32_rows(value, choice.options, start, meta, what)
        anchored_pos(rows.rows, prompt, completion, start, what=what)
        sources.append(rows)
    mask = meta_info.get(SAMPLING_MASK)
    top_p = next(
        (keys for keys in TOP_P_KEYS if keys[0] in meta_info or keys[1] in meta_info), None
    )
    if choice.wants(MASK_FIELD) and top_p is not None:
        if not reads_top_p:
            raise WireFormatError(
                f"{where}: holds slime's top-p masks ({top_p[0]!r}), which the {entry.name!r} "
                "format does not read (the 'slime' format reads them, from /generate bodies)"
            )
        if mask is not None:
            raise WireFormatError(
                f"{where}: expected one mask, found both {SAMPLING_MASK!r} and {top_p[0]!r}"
            )
        sources.append(top_p_rows(meta_info, top_p, prompt, completion, meta, where))
    elif choice.wants(MASK_FIELD) and mask is not None:
        where_mask = f"{where}.{SAMPLING_MASK}"
        sources.append(kept_id_rows(MASK_FIELD, mask, prompt, completion, meta, where_mask))
    return ChoiceRows(choice.index, tuple(sources), missing)


def top_p_rows(
    meta_info: Mapping[str, Any],
    keys: tuple[str, str],
    prompt: int | None,
    completion: int | None,
    meta: dict[str, Any],
    where: str,
) -> InlineRows:
    """``sampling_mask`` rows of slime's kept ids and their ``completion + 1`` offsets (from
    0): row i, completion token i at ``prompt + i``, is ``ids[offsets[i]:offsets[i + 1]]``;
    an empty row is no mask there (the full vocabulary)."""
    ids_key, offsets_key = keys
    what = f"{where}.{offsets_key}"
    if prompt is None:
        raise WireFormatError(f"{what}: cannot place the mask rows without the prompt length")
    ids = int32_blob(meta_info.get(ids_key), f"{where}.{ids_key}")
    offsets = int32_blob(meta_info.get(offsets_key), what)
    if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != ids.size:
        found = offsets[:1].tolist() + offsets[-1:].tolist() if offsets.size else "none"
        raise WireFormatError(
            f"{what}: expected offsets from 0 to the {ids.size} ids, found first and last {found}"
        )
    counts = np.diff(offsets)
    if completion is not None and counts.size != completion:
        raise WireFormatError(
            f"{what}: expected one offset per completion token ({completion}) and one more, "
            f"found {offsets.size} (first position {prompt})"
        )
    if counts.size and int(counts.min()) < 0:
        raise WireFormatError(
            f"{what}: expected offsets that never decrease, found {int(offsets[counts.argmin()])} "
            f"then {int(offsets[counts.argmin() + 1])} at token {int(counts.argmin())}"
        )
    ids, counts = check_csr(ids, counts, what=where)
    return InlineRows(MASK_FIELD, RaggedRows.from_lengths(ids, counts, what=where), prompt, meta)


def flat_int32_base64(routes: np.ndarray) -> str:
    """Base64 of the flat int32 ids, as SGLang's detokenizer writes them."""
    return array_base64(routes.astype(INT32, copy=False))


def _final_chunks(raw: Any, what: str) -> Any:
    """The chunks of a ``/generate`` stream that carry the routes: each item's last (SGLang
    sends them when the item finishes; its chunks are cumulative). A batch's items interleave,
    each chunk tagged with its ``index``: they give a list, as the batch's body does."""
    chunks = [parse_response(event, (ROUTES_FIELD,)) for event in stream_events(raw, what)]
    if not chunks:
        raise WireFormatError(f"{what}: no events")
    indices = [
        nonnegative_int(
            f"{what} event {number} index",
            chunk.get("index", 0) if isinstance(chunk, Mapping) else 0,
            WireFormatError,
        )
        for number, chunk in enumerate(chunks)
    ]
    last = {index: number for number, index in enumerate(indices)}
    masks: dict[int, list[Any]] = {}
    for number, (chunk, index) in enumerate(zip(chunks, indices, strict=True)):
        meta_info = meta_info_of(chunk)
        routed = meta_info is not None and meta_info.get(ROUTES_FIELD) is not None
        if number != last[index] and routed:
            raise WireFormatError(
                f"{what}: routes on event {number} of {len(chunks)}, before item {index}'s "
                f"last chunk (event {last[index]}); SGLang sends them in an item's final chunk "
                f"only"
            )
        if meta_info is not None and meta_info.get(SAMPLING_MASK) is not None:
            masks[index] = _joined_mask(masks.get(index, []), meta_info, f"{what} event {number}")
            if number == last[index]:
                meta_info[SAMPLING_MASK] = masks[index]
        elif number == last[index] and index in masks:
            raise WireFormatError(
                f"{what}: item {index}'s last chunk (event {number}) has no {SAMPLING_MASK}, "
                f"expected one after the {len(masks[index])} rows of its earlier chunks"
            )
    count = check_stream_choices(last, what)
    batched = any(isinstance(c, Mapping) and "index" in c for c in chunks)
    finals = [chunks[last[index]] for index in range(count)]
    return finals if batched else finals[0]


def _joined_mask(earlier: list[Any], meta_info: Mapping[str, Any], what: str) -> list[Any]:
    """An item's mask rows so far: a chunk's ``output_token_sampling_mask`` holds the rows
    from ``output_token_sampling_mask_length - len(rows)`` on (all of them when cumulative,
    the delta under ``--incremental-streaming-output``; tokenizer_manager.py
    ``_slice_streaming_output_meta_info``), after the rows the earlier chunks gave."""
    rows = meta_info[SAMPLING_MASK]
    if type(rows) is not list:
        raise WireFormatError(
            f"{what}: {SAMPLING_MASK}: expected a list of kept-id lists, found "
            f"{type(rows).__name__}"
        )
    total = meta_info.get(MASK_LENGTH, len(rows))
    first = nonnegative_int(f"{what} {MASK_LENGTH}", total, WireFormatError) - len(rows)
    if not 0 <= first <= len(earlier):
        raise WireFormatError(
            f"{what}: {len(rows)} {SAMPLING_MASK} rows of {total} ({MASK_LENGTH}) follow "
            f"{len(earlier)} rows of the item's earlier chunks; expected the chunk to hold "
            f"them all or the rows after them"
        )
    if first == 0:  # cumulative
        return rows
    if first == len(earlier):  # the delta: joined in place, not copied per chunk
        earlier.extend(rows)
        return earlier
    return earlier[:first] + rows


def meta_info_of(item: object) -> Mapping[str, Any] | None:
    """An item's ``meta_info`` object, else None."""
    meta_info = item.get("meta_info") if isinstance(item, Mapping) else None
    return meta_info if isinstance(meta_info, Mapping) else None


class SglangFormat(ProducerFormat):
    name = "sglang"
    producer = "SGLang"
    versions = "0.5.12-0.5.23 (/generate meta_info; batch lists; streams: the final chunk)"
    fields = (ROUTES_FIELD, MASK_FIELD)
    options = SglangOptions
    spliced = (ROUTES_FIELD,)
    stream_assembler = staticmethod(_final_chunks)

    reads_top_p = False
    """Whether it reads slime's top-p masks (:func:`top_p_rows`)."""

    def recognise(self, doc: Any) -> bool:
        items = doc if isinstance(doc, list) else documents(doc)
        return any(self.carries(item) for item in items)

    def carries(self, item: object) -> bool:
        """Whether one item of a body is this format's."""
        meta_info = meta_info_of(item)
        return meta_info is not None and isinstance(meta_info.get(ROUTES_FIELD), str)

    def choices(self, parsed: Any, options: ShapeOptions) -> list[tuple[int, Any]]:
        """The items of a batch list (all, or ``options.choice``); a single response is one."""
        items = parsed if isinstance(parsed, list) else [parsed]
        if options.choice is not None and options.choice >= len(items):
            raise ConfigError(
                f"{self.name} response: choice {options.choice} out of range; it has "
                f"{len(items)} items"
            )
        picked = range(len(items)) if options.choice is None else (options.choice,)
        return [(index, items[index]) for index in picked]

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        meta_info = meta_info_of(choice.entry)
        if meta_info is None:
            raise WireFormatError(
                f"{self.name} [{choice.index}]: expected an object with 'meta_info'"
            )
        where = f"{self.name} [{choice.index}].meta_info"
        return meta_info_rows(self, choice, meta_info, where, reads_top_p=self.reads_top_p)

    def meta_info(self, request: EngineRequest) -> dict[str, Any]:
        """The ``meta_info`` of a body for ``request`` (fields in SGLang's order)."""
        return {
            "id": "r3data-synth",
            "finish_reason": {"type": "length", "length": request.completion_len},
            "prompt_tokens": request.prompt_len,
            "completion_tokens": request.completion_len,
            "cached_tokens": 0,
            ROUTES_FIELD: flat_int32_base64(request.routes),
        }

    def encode(self, request: EngineRequest) -> bytes:
        """A ``/generate`` body for one prompt."""
        self.check_start(request)
        output_ids = [int(t) for t in request.completion_ids]
        body = {"text": "", "output_ids": output_ids, "meta_info": self.meta_info(request)}
        return orjson.dumps(body)


FORMAT = SglangFormat()


def sglang_routes(
    response: Any, *, num_layers: int, topk: int, start: int | None = None
) -> list[RowSource]:
    """Routes of an SGLang ``/generate`` response (one object or a batch list), one per item:
    the ``"sglang"`` format's rows. ``start`` is the request's ``routed_experts_start_len``."""
    options = SglangOptions(num_layers=num_layers, topk=topk, start=start or 0)
    return sources_of(FORMAT.decode(response, options, fields=frozenset({ROUTES_FIELD})))
