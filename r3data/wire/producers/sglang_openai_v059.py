"""SGLang 0.5.9-0.5.11 OpenAI endpoints: as 0.5.12+, but ``routed_experts_start_len`` is
accepted and not forwarded (serving_chat.py / serving_completions.py build the internal
request without it), so rows always start at 0 and this format takes no ``start``."""

from __future__ import annotations

from r3data.wire.producers.base import ShapeOptions
from r3data.wire.producers.sglang_openai import SglangOpenaiFormat

__all__ = ["FORMAT", "SglangOpenai059Format"]


class SglangOpenai059Format(SglangOpenaiFormat):
    name = "sglang-openai-0.5.9"
    versions = "0.5.9-0.5.11 (OpenAI endpoints; routed_experts_start_len not forwarded)"
    options = ShapeOptions
    prompt_start = False
    current = False


FORMAT = SglangOpenai059Format()
