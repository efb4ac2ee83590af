"""SGLang 0.5.7-0.5.11 ``/generate``: as 0.5.12+, but ``routed_experts_start_len`` is ignored.

0.5.8-0.5.11 accept the request field (managers/io_struct.py) and never pass it to the
capturer (srt/layers/moe/routed_experts_capturer.py ``get_routed_experts`` reads ``[:
seqlen - 1]``); 0.5.7 has no such field. Rows always cover ``[0, prompt + completion - 1)``,
so this format takes no ``start``. The body is the same as 0.5.12+'s: ``r3data inspect``
cannot tell them apart (it reads both as ``sglang``, whose default start is 0 too).
"""

from __future__ import annotations

from r3data.wire.producers.base import ShapeOptions
from r3data.wire.producers.sglang import SglangFormat

__all__ = ["FORMAT", "Sglang057Format"]


class Sglang057Format(SglangFormat):
    name = "sglang-0.5.7"
    versions = "0.5.7-0.5.11 (/generate meta_info; routed_experts_start_len ignored)"
    options = ShapeOptions
    prompt_start = False
    current = False


FORMAT = Sglang057Format()
