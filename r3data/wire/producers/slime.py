"""slime's patched SGLang ``/generate``: SGLang's routes, and sampling masks as top-p sets.

slime (THUDM/slime 624b824a8, docker/patch/latest/sglang-top_p.patch, also for SGLang
v0.5.15.post1: tokenizer_manager.py ``_encode_top_p_token_ids``; read by slime/utils/types.py
``_extract_rollout_top_p_token_data`` and backends/megatron_utils/loss.py) asks with
``sampling_params.custom_params.return_top_p_token_ids`` and, once the request finishes, adds to
``meta_info``:

- ``top_p_token_ids``: base64 of little-endian int32, every output token's kept ids back to back;
- ``top_p_token_offsets``: base64 of int32, ``completion_tokens + 1`` offsets from 0; completion
  token i (at ``prompt + i``) kept ``ids[offsets[i]:offsets[i + 1]]`` (greedy: the sampled id);
  an empty row records no nucleus there, which slime's loss reads as the full vocabulary.
  slime's reader also takes ``top_p_kept_token_ids`` / ``top_p_kept_token_offsets``.

Routes are SGLang 0.5.12+'s (:mod:`~r3data.wire.producers.sglang`); the ``"sglang"`` format
refuses a body holding these masks when a sampling mask is asked for, rather than drop them.
"""

from __future__ import annotations

from typing import Any

from r3data.wire.producers.base import EngineRequest
from r3data.wire.producers.sglang import (
    TOP_P_KEYS,
    SglangFormat,
    flat_int32_base64,
    meta_info_of,
)

__all__ = ["FORMAT", "SlimeFormat"]


class SlimeFormat(SglangFormat):
    name = "slime"
    producer = "slime"
    versions = "624b824a8 (its SGLang patch: meta_info top_p_token_ids, top_p_token_offsets)"
    reads_top_p = True

    def carries(self, item: object) -> bool:
        meta_info = meta_info_of(item)
        return super().carries(item) and any(keys[1] in meta_info for keys in TOP_P_KEYS)

    def meta_info(self, request: EngineRequest) -> dict[str, Any]:
        """SGLang's ``meta_info``, with the request's sampling mask as slime sends it."""
        meta_info = super().meta_info(request)
        mask = request.sampling_mask
        if mask is not None:
            ids, offsets = mask.compact()
            meta_info["top_p_token_ids"] = flat_int32_base64(ids)
            meta_info["top_p_token_offsets"] = flat_int32_base64(offsets)
        return meta_info


FORMAT = SlimeFormat()
