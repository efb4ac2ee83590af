"""prime-rl response bodies: inline envelopes, kept-token masks, P/D merges, by-handle payloads.

prime-rl serves ``POST /inference/v1/generate`` by subclassing vLLM's ``ServingTokens``
(prime-rl src/prime_rl/inference/vllm/serving_tokens.py, on vLLM 0.26.0 per uv.lock at
559b44772e, 2026-08-21) and replaces vLLM's ``.npy`` string with its own envelope
(src/prime_rl/inference/vllm/routed_experts.py ``serialize_routed_experts``). The rows are
vLLM's ``output.routed_experts``: ``[start, prompt + completion - 1)``, all decoder layers,
with ``start = sampling_params.routed_experts_prompt_start``.

Envelope versions on prime-rl main:

- v1 (1e0fe9637, 2026-05-23): ``{"data", "shape"}``, uint8;
- v2 (ae748fd69, 2026-05-28): ``{"data", "shape", "start"}``, uint8;
- v3 (6b1604380, 2026-07-16, current): ``{"data", "shape", "start", "dtype"}``, ``dtype``
  uint8, or uint16 when an id in *this* array exceeds 255 (chosen per response from the ids
  present, not from the model's expert count).

Readers: verifiers v1/graph.py ``_attribute_routed_experts`` (``dtype`` defaults to uint8,
``start`` to 0, row ``i`` is position ``start + i``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from .common import b64_raw, check_routes, starlette_body

__all__ = [
    "generate_body",
    "kept_tokens_field",
    "payload_body",
    "pd_merge_inline",
    "pd_merge_payload",
    "pd_payload_request",
    "routed_experts_envelope",
]


def routed_experts_envelope(
    rows: np.ndarray | None, start: int = 0, version: int = 3
) -> dict | None:
    """``serialize_routed_experts(routed_experts, start)`` at envelope version 1, 2 or 3.

    ``rows`` are what vLLM returned (already from ``start``); ``None`` gives ``None`` (the
    choice's ``routed_experts`` is then null). Keys in this order; ``data`` first.
    """
    if rows is None:
        return None
    rows = check_routes(rows)
    dtype = np.uint8
    if rows.size and int(rows.max()) > 255:
        if version < 3:
            raise ValueError("prime-rl before 6b1604380 asserted ids <= 255")
        dtype = np.uint16
    compact = np.ascontiguousarray(rows.astype(dtype))
    envelope = {"data": b64_raw(compact), "shape": list(compact.shape)}
    if version >= 2:
        envelope["start"] = start
    if version >= 3:
        envelope["dtype"] = np.dtype(dtype).name
    return envelope


def kept_tokens_field(kept_rows: Sequence[np.ndarray] | None, num_tokens: int) -> dict | None:
    """``serialize_kept_tokens`` (prime-rl branch ``feat/sampling-replay`` d09488d57,
    2026-08-11, src/prime_rl/inference/vllm/kept_tokens.py; not on main).

    ``{"ids": b64(int32 concat), "counts": b64(int32[num_tokens])}``: bare base64 of raw
    little-endian int32 bytes, not envelopes (no shape, no dtype). ``kept_rows`` is one array
    per sampling step; it is cut to ``num_tokens`` (stop trimming) or padded with empty rows.
    A count of 0 means no usable mask at that token (not truncated, greedy, or wider than
    ``SAMPLING_MASK_MAX = 512``): the trainer uses the full vocabulary there. ``None`` (so
    ``"kept_tokens": null`` in the choice) when nothing was captured or every count is 0.
    """
    if not kept_rows:
        return None
    rows = list(kept_rows[:num_tokens])
    rows += [np.empty(0, np.int32)] * (num_tokens - len(rows))
    counts = np.fromiter((len(row) for row in rows), dtype=np.int32, count=num_tokens)
    if not int(counts.sum()):
        return None
    ids = np.ascontiguousarray(np.concatenate(rows).astype(np.int32))
    return {"ids": b64_raw(ids), "counts": b64_raw(counts)}


def generate_body(
    choices: Sequence[dict],
    *,
    prompt_len: int,
    with_kept_tokens: bool = False,
) -> bytes:
    """A prime-rl ``/inference/v1/generate`` body (vLLM 0.26.0 ``GenerateResponse`` schema).

    ``choices`` items: ``{"token_ids": [...], "routed_experts": <envelope or None>}`` and,
    with ``with_kept_tokens`` (the sampling-replay branch), ``"kept_tokens": <field or None>``.
    serving_tokens.py ``PrimeRlGenerateResponseChoice`` re-declares ``routed_experts`` (it
    keeps its place after ``token_ids``) and adds ``kept_tokens`` last; vLLM's api_router
    returns ``JSONResponse(content=model_dump())``, so null fields are present. The response
    has no ``prompt_token_ids``: the prompt length is the request's ``len(token_ids)``.
    """
    out = []
    for index, choice in enumerate(choices):
        entry = {
            "index": index,
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": list(choice["token_ids"]),
            "routed_experts": choice.get("routed_experts"),
        }
        if with_kept_tokens:
            entry["kept_tokens"] = choice.get("kept_tokens")
        out.append(entry)
    completion = sum(len(c["token_ids"]) for c in choices)
    body = {
        "request_id": "generate-tokens-r3data",
        "model": "tiny-moe",
        "created": 1_760_000_000,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
    return starlette_body(body)


def pd_merge_inline(prefill_envelope: dict, decode_envelope: dict) -> dict:
    """What PrimeIntellect-ai/router (src/routers/http/routed_experts_merge.rs
    ``merge_routed_experts_in_json``, envelope version at 02403201136d) writes into each decode
    choice under P/D disaggregation: the prefill's rows (``choices[0].routed_experts`` of the
    prefill response), then the decode's rows after dropping as many rows as the prefill
    has (``suffix_rows(prompt.seq_len)``). The prefill's rows win for every position it
    covers; the decode's own prompt rows are discarded whatever they hold.

    The merged envelope is ``{"data", "shape", "start"}`` with no ``dtype`` and uint8 bytes:
    the router checks ``len(data) == rows * layers * topk`` (one byte per id), so a uint16
    payload fails the merge rather than passing through.
    """
    import base64

    def rows_of(envelope: dict) -> np.ndarray:
        data = np.frombuffer(base64.b64decode(envelope["data"]), dtype=np.uint8)
        return data.reshape(envelope["shape"])

    prompt = rows_of(prefill_envelope)
    decode = rows_of(decode_envelope)
    if decode.shape[0] < prompt.shape[0]:
        raise ValueError("decode routed_experts has fewer rows than the prefill")
    merged = np.concatenate([prompt, decode[prompt.shape[0] :]])
    return {
        "data": b64_raw(merged),
        "shape": list(merged.shape),
        "start": prefill_envelope["start"],
    }


def payload_body(
    *,
    file: str,
    routes: np.ndarray | None,
    routes_pos: int,
    mask: np.ndarray | None = None,
    mask_pos: int | None = None,
    token_ids: Sequence[int] = (),
) -> tuple[bytes, bytes]:
    """A by-handle choice: ``choices[i].payload = [segment, ...]`` and the file bytes.

    Segment keys and order as PrimeIntellect-ai/router's ``merge_routed_payload_in_json``
    and its tests read them: ``field``, ``file``, ``offset``, ``pos``, ``rows``, ``dtype``,
    ``shape`` (one row's shape). ``routed_experts`` segments hold raw route rows;
    ``sampling_mask`` segments int32 ``[tokens, widest]`` rows padded with -1 (the mask
    field of the issue; mask row ``i`` at position ``prompt_len + i``). The writer that
    produces these files is not public: the file layout here (the segments' rows back to
    back, no header) is this module's own, so tests should place the bytes in r3data's
    payload file format themselves. Returns ``(body, file_bytes)``.
    """
    segments = []
    blob = bytearray()
    if routes is not None:
        routes = np.ascontiguousarray(check_routes(routes))
        segments.append(
            {
                "field": "routed_experts",
                "file": file,
                "offset": len(blob),
                "pos": routes_pos,
                "rows": routes.shape[0],
                "dtype": routes.dtype.name,
                "shape": list(routes.shape[1:]),
            }
        )
        blob += routes.tobytes()
    if mask is not None:
        mask = np.ascontiguousarray(np.asarray(mask, dtype=np.int32))
        segments.append(
            {
                "field": "sampling_mask",
                "file": file,
                "offset": len(blob),
                "pos": mask_pos,
                "rows": mask.shape[0],
                "dtype": "int32",
                "shape": list(mask.shape[1:]),
            }
        )
        blob += mask.tobytes()
    body = {"choices": [{"index": 0, "token_ids": list(token_ids), "payload": segments}]}
    return starlette_body(body), bytes(blob)


def pd_merge_payload(prefill: dict, decode: dict) -> dict:
    """``merge_routed_payload_in_json`` (PrimeIntellect-ai/router routed_experts_merge.rs,
    02403201136d): each decode choice gets the prefill's ``routed_experts`` segments first,
    then its own segments, with ``routed_experts`` segments that end at or before the
    prefill's coverage end (max ``pos + rows``) dropped and ones that straddle it clipped
    (``offset += (cut - pos) * row_bytes``, ``pos = cut``); other fields pass through.
    ``prefill`` and ``decode`` are parsed bodies; returns the merged decode body.
    """
    itemsize = {
        "uint8": 1,
        "int8": 1,
        "bool": 1,
        "uint16": 2,
        "int16": 2,
        "float16": 2,
        "bfloat16": 2,
        "uint32": 4,
        "int32": 4,
        "float32": 4,
        "uint64": 8,
        "int64": 8,
        "float64": 8,
    }
    prefill_segments = [
        s for s in prefill["choices"][0].get("payload") or [] if s["field"] == "routed_experts"
    ]
    cut = max((s["pos"] + s["rows"] for s in prefill_segments), default=0)
    for choice in decode["choices"]:
        merged = [dict(s) for s in prefill_segments]
        for segment in choice.get("payload") or []:
            segment = dict(segment)
            if segment["field"] == "routed_experts":
                pos, rows = segment["pos"], segment["rows"]
                if pos + rows <= cut:
                    continue
                if pos < cut:
                    row_bytes = itemsize[segment["dtype"]] * int(np.prod(segment["shape"]))
                    segment["offset"] += (cut - pos) * row_bytes
                    segment["pos"] = cut
                    segment["rows"] = pos + rows - cut
            merged.append(segment)
        choice["payload"] = merged
    return decode


def pd_payload_request(
    prefill_rows: np.ndarray,
    decode_rows: np.ndarray,
    mask: np.ndarray,
    completion_ids: Sequence[int],
    *,
    prefill_file: str = "v3/p.bin",
    decode_file: str = "v3/d.bin",
) -> tuple[bytes, dict[str, bytes]]:
    """One request by handle under P/D: the prefill instance's payload (its prompt rows, from
    position 0, in ``prefill_file``), the decode instance's (its rows from position 0 and the
    mask from the prompt's end, in ``decode_file``), merged by :func:`pd_merge_payload`.
    Returns the merged body and each file's bytes by name."""
    prefill, prefill_bytes = payload_body(file=prefill_file, routes=prefill_rows, routes_pos=0)
    decode, decode_bytes = payload_body(
        file=decode_file,
        routes=decode_rows,
        routes_pos=0,
        mask=mask,
        mask_pos=len(prefill_rows),
        token_ids=completion_ids,
    )
    merged = pd_merge_payload(json.loads(prefill), json.loads(decode))
    return json.dumps(merged).encode(), {prefill_file: prefill_bytes, decode_file: decode_bytes}
