"""r3data's CSR sampling masks: ``choices[i].sampling_mask = {"ids": <int32 envelope>,
"counts": <int32 envelope>}``.

An earlier r3data reading of prime-rl's masks, kept for bodies written that way (no prime-rl
release sends it: prime-rl's masks are ``kept_tokens``, bare base64, in
:mod:`~r3data.wire.producers.primerl`). ``counts[i]`` is the size of completion token i's
kept set, at position ``prompt_len + i``; a count of 0 is no mask there (the full
vocabulary), as in ``kept_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from r3data.errors import ConfigError, WireFormatError
from r3data.ragged import RaggedRows
from r3data.wire.masks import pack_csr, unpack_csr
from r3data.wire.producers.base import (
    MASK_FIELD,
    Choice,
    ChoiceOptions,
    ChoiceRows,
    EngineRequest,
    Lengths,
    ProducerFormat,
)
from r3data.wire.producers.common import (
    any_choice,
    sources_of,
)
from r3data.wire.rows import InlineRows

__all__ = ["FORMAT", "PrimeRlSamplingMaskFormat", "primerl_sampling_mask"]


class PrimeRlSamplingMaskFormat(ProducerFormat):
    name = "prime-rl-sampling-mask"
    producer = "r3data"
    versions = "r3data's CSR envelopes (not a prime-rl release format)"
    fields = (MASK_FIELD,)
    options = ChoiceOptions
    spliced = (MASK_FIELD,)
    current = False

    def recognise(self, doc: Any) -> bool:
        return any_choice(doc, lambda c: isinstance(c.get(MASK_FIELD), Mapping))

    def decode_choice(self, choice: Choice) -> ChoiceRows:
        what = f"{self.name} choices[{choice.index}].{MASK_FIELD}"
        prompt, completion = choice.placed(what)
        value = choice.entry.get(MASK_FIELD)
        if value is None:
            return ChoiceRows(choice.index, (), (what,))
        ids, counts = unpack_csr(value, what=what)
        if prompt is None:
            raise WireFormatError(f"{what}: cannot place the mask rows without the prompt length")
        if completion is not None and counts.size != completion:
            raise WireFormatError(
                f"{what}: expected one kept-set size per completion token ({completion}), "
                f"found {counts.size}"
            )
        meta = self.rows_meta(choice, prompt, counts.size)
        rows = RaggedRows.from_lengths(ids, counts, what=what)
        return ChoiceRows(choice.index, (InlineRows(MASK_FIELD, rows, prompt, meta),))

    def encode(self, request: EngineRequest) -> bytes:
        if request.sampling_mask is None:
            raise ConfigError(f"{self.name}: a body needs the request's sampling mask")
        values, offsets = request.sampling_mask.compact()
        choice = {
            "index": 0,
            "token_ids": [int(t) for t in request.completion_ids],
            MASK_FIELD: pack_csr(values, offsets[1:] - offsets[:-1]),
        }
        return orjson.dumps({"choices": [choice]})


FORMAT = PrimeRlSamplingMaskFormat()


def primerl_sampling_mask(
    response: Any,
    *,
    choice: int | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
) -> list[InlineRows]:
    """Sampling masks of each choice (or of ``choice``) as ragged rows (CSR) at
    ``prompt_len + i``: the ``"prime-rl-sampling-mask"`` format's rows."""
    lengths = Lengths(prompt_len, completion_len)
    return sources_of(FORMAT.decode(response, ChoiceOptions(choice=choice), lengths))
