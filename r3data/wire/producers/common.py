"""What every producer decoder shares: reading a response, choices, lengths, blobs as rows.

Decoders report what they saw and place it: rows with positions and the producer's metadata.
They decode nothing they can leave encoded (the loader decodes each blob once, straight into
the batch buffer) and apply no policy to the ids; the loader's one screen does that
(:mod:`r3data.nodes.screen`).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from typing import Any

import numpy as np

from r3data.errors import ConfigError, R3DataError, WireFormatError
from r3data.validate import nonnegative_int
from r3data.wire.blob import Blob, decode_base64, decoded_length
from r3data.wire.envelope import array_from_buffer, check_nbytes
from r3data.wire.rows import EncodedRows, InlineRows, RowSource
from r3data.wire.splice import load_packed_body

__all__ = [
    "blob_nbytes",
    "check_route_shape",
    "choice_token_lengths",
    "envelope_rows",
    "flat_rows",
    "optional_position",
    "parse_response",
    "raw_blob",
    "select_choices",
]

_RAW_BODIES = (bytes, bytearray, memoryview, mmap.mmap)


def parse_response(response: Any, fields: tuple[str, ...]) -> Any:
    """A raw body is spliced with :func:`load_packed_body` (blobs left encoded); a parsed one
    is used as is."""
    if isinstance(response, _RAW_BODIES):
        return load_packed_body(response, fields, decode=False)
    if isinstance(response, Mapping | list):
        return response
    raise WireFormatError(
        f"response: expected a raw JSON body or a parsed object, found {type(response).__name__}"
    )


def select_choices(
    response: Any, choice: int | None, what: str
) -> list[tuple[int, Mapping[str, Any]]]:
    """``[(index, choice), ...]`` from an OpenAI-style ``choices`` list (all, or one)."""
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list):
        raise WireFormatError(f"{what}: expected a response with a 'choices' list")
    if choice is not None and not 0 <= choice < len(choices):
        raise ConfigError(f"{what}: choice {choice} out of range; response has {len(choices)}")
    picked = range(len(choices)) if choice is None else (choice,)
    selected = []
    for index in picked:
        if not isinstance(choices[index], Mapping):
            raise WireFormatError(
                f"{what}: choices[{index}]: expected an object, found "
                f"{type(choices[index]).__name__}"
            )
        selected.append((index, choices[index]))
    return selected


def choice_token_lengths(
    response: Mapping[str, Any], choice: Mapping[str, Any]
) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` from vLLM-style token id lists, where present.

    vLLM puts ``prompt_token_ids`` in each choice (completions) or at the top level (chat)
    and the sampled ids in ``choices[i].token_ids`` when ``return_token_ids`` is set.
    """
    prompt = choice.get("prompt_token_ids")
    if prompt is None:
        prompt = response.get("prompt_token_ids")
    completion = choice.get("token_ids")
    return (
        len(prompt) if isinstance(prompt, list) else None,
        len(completion) if isinstance(completion, list) else None,
    )


def optional_position(value: object, what: str, error: type[R3DataError]) -> int | None:
    """``None`` or a non-negative int; anything else raises ``error``."""
    return None if value is None else nonnegative_int(what, value, error)


def raw_blob(value: object, what: str) -> bytes | bytearray | memoryview | Blob | str:
    """A bare base64 field as it arrived: encoded (a :class:`Blob` of a spliced body, a parsed
    ``str``) or already decoded bytes."""
    if isinstance(value, Blob | str | bytes | bytearray | memoryview):
        return value
    if value is None:
        raise WireFormatError(
            f"{what}: no routes (null or absent); was the request sent with routes enabled?"
        )
    raise WireFormatError(f"{what}: expected a base64 string, found {type(value).__name__}")


def _encoded(value: object) -> memoryview | str | None:
    """The base64 characters of a value still encoded, else None."""
    if isinstance(value, Blob):
        return value.chars
    return value if isinstance(value, str) else None


def blob_nbytes(value: object, what: str) -> int:
    """Bytes a bare blob holds (or decodes to), known without decoding it."""
    blob = raw_blob(value, what)
    chars = _encoded(blob)
    return len(blob) if chars is None else decoded_length(chars, what)


def flat_rows(
    field: str,
    value: object,
    *,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    pos: int,
    skip: int = 0,
    meta: Mapping[str, Any] | None = None,
    what: str,
) -> RowSource:
    """Rows of ``row_shape`` back to back after ``skip`` bytes of a bare blob, as many as it
    holds exactly (a partial row is refused): encoded, or a view of decoded bytes."""
    blob = raw_blob(value, what)
    chars = _encoded(blob)
    per_row = dtype.itemsize * math.prod(row_shape)
    nbytes = blob_nbytes(blob, what) - skip
    if nbytes < 0 or nbytes % per_row:
        raise WireFormatError(
            f"{what}: expected whole rows of {list(row_shape)} {dtype.name} ({per_row} bytes "
            f"each) after byte {skip}, found {max(nbytes, 0)} bytes"
        )
    rows = nbytes // per_row
    if chars is not None:
        return EncodedRows(
            field,
            chars,
            dtype=dtype,
            row_shape=row_shape,
            rows=rows,
            pos=pos,
            skip=skip,
            meta=meta,
            what=what,
        )
    view = memoryview(blob).cast("B")[skip:]
    return InlineRows(
        field, array_from_buffer(view, dtype, (rows, *row_shape), what=what), pos, meta
    )


def envelope_rows(
    envelope: Mapping[str, Any],
    field: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    pos: int,
    meta: Mapping[str, Any] | None = None,
    what: str,
) -> RowSource:
    """The rows of an envelope whose ``dtype`` and ``shape`` :func:`envelope_spec` checked:
    encoded when its data still is, else the decoded array."""
    data = envelope["data"]
    where = f"{what}.data (shape {list(shape)}, {dtype.name})"
    chars = _encoded(data)
    if chars is not None:
        check_nbytes(decoded_length(chars, where), dtype, shape, what=where)
        return EncodedRows(
            field,
            chars,
            dtype=dtype,
            row_shape=shape[1:],
            rows=shape[0],
            pos=pos,
            meta=meta,
            what=what,
        )
    if isinstance(data, bytes | bytearray | memoryview):
        data = array_from_buffer(decode_base64(data, what=where), dtype, shape, what=where)
    if not isinstance(data, np.ndarray) or data.dtype != dtype or data.shape != shape:
        found = (
            f"{list(data.shape)} and {data.dtype}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise WireFormatError(
            f"{where}: expected base64 or an array of shape {list(shape)} and {dtype.name}, "
            f"found {found}"
        )
    return InlineRows(field, data, pos, meta)


def check_route_shape(routes: RowSource, what: str) -> None:
    if len(routes.row_shape) != 2 or 0 in routes.row_shape:
        raise WireFormatError(
            f"{what}: expected routes [rows, layers > 0, topk > 0], found rows of "
            f"{list(routes.row_shape)}"
        )
