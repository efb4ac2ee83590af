"""What every producer format shares: reading a body (spliced, plain or a stream), choices,
lengths, blobs and nested lists as rows; blobs and usage for the bodies formats synthesise.

Decoders report what they saw and place it: rows with positions and the producer's metadata.
They decode nothing they can leave encoded (the loader decodes each blob once, straight into
the batch buffer) and apply no policy to the ids; the loader's one screen does that
(:mod:`r3data.nodes.screen`).
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson
import pybase64

from r3data.errors import ConfigError, R3DataError, WireFormatError
from r3data.ragged import MAX_TOKEN_ID, RaggedRows
from r3data.validate import checked_int, nonnegative_int
from r3data.wire.blob import Blob, byte_view, decode_base64, decoded_length
from r3data.wire.dtypes import compact_route_dtype
from r3data.wire.envelope import array_from_buffer, check_nbytes
from r3data.wire.masks import check_csr
from r3data.wire.producers.request import EngineRequest, Lengths
from r3data.wire.rows import EncodedRows, InlineRows, RowSource, check_route_row_shape
from r3data.wire.splice import load_packed_body

__all__ = [
    "INT32",
    "Stream",
    "any_choice",
    "array_base64",
    "blob_nbytes",
    "blob_rows",
    "check_route_shape",
    "choice_token_lengths",
    "documents",
    "encoded_chars",
    "envelope_rows",
    "int32_blob",
    "is_stream",
    "kept_id_rows",
    "nested_rows",
    "openai_usage",
    "optional_position",
    "parse_plain",
    "parse_response",
    "placed_lengths",
    "raw_blob",
    "select_choices",
    "sniff",
    "sources_of",
    "stream_events",
    "token_counts",
]

_RAW_BODIES = (bytes, bytearray, memoryview, mmap.mmap)
_BLOB_KINDS = frozenset({Blob, str, bytes, bytearray, memoryview})
"""What :func:`raw_blob` takes, tested by exact type first."""
INT32 = np.dtype("<i4")
"""The little-endian int32 of bare id blobs (SGLang's routes, CSR masks)."""


def parse_response(response: Any, fields: tuple[str, ...]) -> Any:
    """A raw body is spliced with :func:`load_packed_body` (blobs left encoded); a parsed one
    is used as is."""
    if type(response) is bytes or isinstance(response, _RAW_BODIES):
        return load_packed_body(response, fields, decode=False)
    if isinstance(response, Mapping | list):
        return response
    raise WireFormatError(
        f"response: expected a raw JSON body or a parsed object, found {type(response).__name__}"
    )


def select_choices(
    response: Any, choice: int | None, what: str
) -> list[tuple[int, Mapping[str, Any]]]:
    """``[(index, choice), ...]`` from an OpenAI-style ``choices`` list (all, or the one whose
    index is ``choice``), in index order.

    A choice is named by its ``index``, not its place in the list: a body may list them in
    any order, and ``choice=k`` is the one whose ``index`` is ``k``. The indices must be
    ``0..n-1``, each once (as :func:`check_stream_choices` asks of a stream); a list whose
    choices carry none is read by position, and one where only some do is refused.
    """
    mapping = type(response) is dict or isinstance(response, Mapping)
    choices = response.get("choices") if mapping else None
    if type(choices) is not list and not isinstance(choices, list):
        raise WireFormatError(f"{what}: expected a response with a 'choices' list")
    if choice is not None and not 0 <= choice < len(choices):
        raise ConfigError(f"{what}: choice {choice} out of range; response has {len(choices)}")
    positions = _choice_positions(choices, what)
    picked = range(len(choices)) if choice is None else (choice,)
    return [(index, choices[positions[index]]) for index in picked]


def _choice_positions(choices: list[Any], what: str) -> range | list[int]:
    """Where each choice sits in ``choices``: ``positions[i]`` is the list position of the
    choice whose ``index`` is ``i`` (its own position where no choice has an ``index``)."""
    for position, entry in enumerate(choices):
        if type(entry) is not dict and not isinstance(entry, Mapping):
            raise WireFormatError(
                f"{what}: choices[{position}]: expected an object, found {type(entry).__name__}"
            )
    indexed = [position for position, entry in enumerate(choices) if "index" in entry]
    if not indexed:
        return range(len(choices))
    if len(indexed) < len(choices):
        bare = next(position for position, entry in enumerate(choices) if "index" not in entry)
        raise WireFormatError(
            f"{what}: expected an 'index' in every choice or in none, found one in "
            f"choices[{indexed[0]}] but none in choices[{bare}]"
        )
    seen: dict[int, int] = {}
    for position, entry in enumerate(choices):
        index = checked_int(
            f"{what} choices[{position}].index", entry["index"], error=WireFormatError
        )
        if index in seen:
            raise WireFormatError(
                f"{what}: expected distinct choice indices, found index {index} in "
                f"choices[{seen[index]}] and choices[{position}]"
            )
        seen[index] = position
    check_stream_choices(seen, what)
    return [seen[index] for index in range(len(choices))]


def any_choice(doc: Any, test: Callable[[Mapping[str, Any]], bool]) -> bool:
    """Whether an object in ``doc``'s OpenAI-style ``choices`` list passes ``test`` (how most
    formats recognise their bodies)."""
    choices = doc.get("choices") if isinstance(doc, Mapping) else None
    return isinstance(choices, list) and any(isinstance(c, Mapping) and test(c) for c in choices)


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
        len(prompt) if type(prompt) is list or isinstance(prompt, list) else None,
        len(completion) if type(completion) is list or isinstance(completion, list) else None,
    )


def optional_position(value: object, what: str, error: type[R3DataError]) -> int | None:
    """``None`` or a non-negative int; anything else raises ``error``."""
    return None if value is None else nonnegative_int(what, value, error)


def token_counts(counts: Mapping[str, Any], what: str) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of an object that counts them (OpenAI's
    ``usage``, SGLang's ``meta_info``), where present; ``what`` prefixes each key."""
    return (
        optional_position(counts.get("prompt_tokens"), f"{what}prompt_tokens", WireFormatError),
        optional_position(
            counts.get("completion_tokens"), f"{what}completion_tokens", WireFormatError
        ),
    )


def raw_blob(value: object, what: str) -> bytes | bytearray | memoryview | Blob | str:
    """A bare base64 field as it arrived: encoded (a :class:`Blob` of a spliced body, a parsed
    ``str``) or already decoded bytes (a memoryview as a view of its bytes)."""
    if type(value) in _BLOB_KINDS or isinstance(value, Blob | str | bytes | bytearray | memoryview):
        return byte_view(value, what) if isinstance(value, memoryview) else value
    if value is None:
        raise WireFormatError(
            f"{what}: no routes (null or absent); was the request sent with routes enabled?"
        )
    raise WireFormatError(f"{what}: expected a base64 string, found {type(value).__name__}")


def int32_blob(value: object, what: str) -> np.ndarray:
    """A bare base64 blob of little-endian int32 values (encoded or already decoded)."""
    blob = raw_blob(value, what)
    if isinstance(blob, Blob):
        decoded = decode_base64(blob.chars, what=what)
    elif isinstance(blob, str):
        decoded = decode_base64(blob, what=what)
    else:
        decoded = blob
    if len(decoded) % INT32.itemsize:
        raise WireFormatError(f"{what}: expected whole int32 values, found {len(decoded)} bytes")
    return np.frombuffer(decoded, INT32)


def encoded_chars(value: object) -> memoryview | str | None:
    """The base64 characters of a value still encoded, else None."""
    if type(value) is Blob:
        return value.chars
    if isinstance(value, Blob):
        return value.chars
    return value if isinstance(value, str) else None


def blob_nbytes(value: object, what: str) -> int:
    """Bytes a bare blob holds (or decodes to), known without decoding it."""
    blob = raw_blob(value, what)
    chars = encoded_chars(blob)
    if chars is None:  # decoded
        return len(blob)
    return decoded_length(chars, what)


def blob_rows(
    field: str,
    blob: bytes | bytearray | memoryview | Blob | str,
    *,
    dtype: np.dtype,
    shape: tuple[int, ...],
    pos: int,
    skip: int = 0,
    meta: Mapping[str, Any] | None = None,
    what: str,
) -> RowSource:
    """The rows of a bare blob holding ``shape`` of ``dtype`` after ``skip`` bytes (its size
    checked against that shape first): encoded, or a view of decoded bytes."""
    chars = encoded_chars(blob)
    if chars is not None:
        return EncodedRows(
            field,
            chars,
            dtype=dtype,
            row_shape=shape[1:],
            rows=shape[0],
            pos=pos,
            skip=skip,
            meta=meta,
            what=what,
        )
    view = memoryview(blob).cast("B")[skip:]
    return InlineRows(field, array_from_buffer(view, dtype, shape, what=what), pos, meta)


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
    chars = encoded_chars(data)
    if chars is not None:
        check_nbytes(decoded_length(chars, where), dtype, shape, what=where)
        return blob_rows(field, data, dtype=dtype, shape=shape, pos=pos, meta=meta, what=what)
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
    check_route_row_shape(routes.row_shape, what)


# --- plain bodies and streams ---------------------------------------------------------------


def parse_plain(response: Any, what: str) -> Any:
    """A raw body parsed as plain JSON (for formats whose rows are JSON lists or strings no
    splice can cut out); a parsed one as is."""
    if isinstance(response, _RAW_BODIES):
        try:
            return orjson.loads(
                memoryview(response) if isinstance(response, mmap.mmap) else response
            )
        except orjson.JSONDecodeError as err:
            raise WireFormatError(f"{what}: invalid JSON near byte {err.pos} ({err.msg})") from None
    if isinstance(response, Mapping | list):
        return response
    raise WireFormatError(
        f"{what}: expected a raw JSON body or a parsed object, found {type(response).__name__}"
    )


class Stream(tuple):
    """A server-sent-event stream's events, parsed (what :func:`sniff` gives for a stream)."""

    __slots__ = ()


def is_stream(response: Any) -> bool:
    """Whether ``response`` is a raw server-sent-event body (``data: ...`` lines)."""
    if type(response) is not bytes and not isinstance(response, _RAW_BODIES):
        return False
    head = bytes(response[:64]).lstrip()
    return head.startswith((b"data:", b"event:", b":"))


def stream_events(raw: bytes | bytearray | memoryview | mmap.mmap, what: str) -> list[bytes]:
    """The data of each server-sent event of ``raw`` (its ``data:`` lines joined), up to the
    ``[DONE]`` that ends OpenAI-style streams; other SSE fields are skipped, anything else is
    a :class:`WireFormatError`."""
    events: list[bytes] = []
    data: list[bytes] = []
    for number, line in enumerate(bytes(raw).split(b"\n")):
        line = line.removesuffix(b"\r")
        if not line:
            if data:
                events.append(b"\n".join(data))
                data = []
            continue
        if line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif not line.startswith((b":", b"event:", b"id:", b"retry:")):
            raise WireFormatError(
                f"{what}: expected server-sent events ('data: ...' lines), found "
                f"{line[:24]!r} on line {number}"
            )
    if data:
        events.append(b"\n".join(data))
    if events and events[-1] == b"[DONE]":
        events.pop()
    if b"[DONE]" in events:
        raise WireFormatError(f"{what}: events after the stream's [DONE]")
    return events


def check_stream_choices(indices: set[int] | dict[int, Any], what: str) -> int:
    """The number of choices a stream's (or a body's) ``index`` values name, which must be
    ``0..n-1``: a choice never comes from a number alone (an index of 10**9 in a short body
    is refused, not allocated)."""
    found = sorted(indices)
    if found != list(range(len(found))):
        shown = ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")
        raise WireFormatError(f"{what}: expected choice indices 0..n-1, found [{shown}]")
    return len(found)


def documents(doc: Any) -> tuple[Any, ...]:
    """The documents of a body :func:`sniff` parsed: a stream's events, else the body alone."""
    return doc if isinstance(doc, Stream) else (doc,)


def sniff(raw: bytes | bytearray | memoryview | mmap.mmap) -> Any:
    """A raw body parsed plainly, for recognising its format: a :class:`Stream` of parsed
    events for a server-sent-event body."""
    if is_stream(raw):
        return Stream(parse_plain(event, "stream event") for event in stream_events(raw, "body"))
    return parse_plain(raw, "body")


# --- lengths and nested lists ---------------------------------------------------------------


def placed_lengths(
    found: tuple[int | None, int | None], lengths: Lengths, role: str, what: str
) -> tuple[int | None, int | None]:
    """``(prompt_len, completion_len)`` of a choice: what the body says, else the request's.

    Where both are known they must agree (a response that is not the request's would misplace
    every row), except a prefill's completion: it sampled one token, the request many.
    """
    prompt = _agreed(found[0], lengths.prompt_len, "prompt", "response", what)
    if role == "prefill":
        return prompt, found[1]
    return prompt, _agreed(found[1], lengths.completion_len, "completion", "choice", what)


def _agreed(found: int | None, known: int | None, tokens: str, whose: str, what: str) -> int | None:
    """A count the body gives (``found``), which must be the request's (``known``) where both
    are known; the request's where the body has none."""
    if found is None:
        return known
    if known is not None and known != found:
        raise WireFormatError(
            f"{what}: the response has {found} {tokens} tokens, the request {known}; is this the "
            f"request's {whose}?"
        )
    return found


def nested_rows(value: object, ndim: int, what: str) -> np.ndarray:
    """Rows sent as nested JSON lists of ints (``ndarray.tolist()``), in the narrowest dtype
    holding them: uint8, uint16 or int32, or int16/int32 when some are negative (-1: no
    route, or padding). Floats, bools, strings and ragged lists are refused."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise WireFormatError(f"{what}: expected nested lists of ints ({err})") from None
    if array.shape == (0,):  # zero rows: ``tolist()`` of an empty array keeps no inner shape
        return np.zeros((0,) * ndim, np.uint8)
    if array.ndim != ndim or array.dtype.kind not in "iu":
        raise WireFormatError(
            f"{what}: expected {ndim}-deep nested lists of ints, found shape {array.shape} of "
            f"{array.dtype}"
        )
    if array.size == 0:
        return array.astype(np.uint8)
    low, high = int(array.min()), int(array.max())
    if low >= 0 and (dtype := compact_route_dtype(high)) is not None:
        return array.astype(dtype)
    for dtype in (np.int16, np.int32):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return array.astype(dtype)
    raise WireFormatError(f"{what}: expected ids in int32, found [{low}, {high}]")


def kept_id_rows(
    field: str,
    value: object,
    prompt: int | None,
    completion: int | None,
    meta: Mapping[str, Any] | None,
    what: str,
) -> InlineRows:
    """Mask rows sent as one JSON list of kept token ids per completion token (vLLM's native
    ``sampling_mask``, ``output.sampling_mask.token_ids``): row i at ``prompt + i``."""
    if type(value) is not list:
        raise WireFormatError(
            f"{what}: expected a list of kept-id lists (one per completion token), found "
            f"{type(value).__name__}"
        )
    if prompt is None:
        raise WireFormatError(f"{what}: cannot place the mask rows without the prompt length")
    if completion is not None and len(value) != completion:
        raise WireFormatError(
            f"{what}: expected one kept set per completion token ({completion}), found "
            f"{len(value)} (first position {prompt})"
        )
    flat = list(itertools.chain.from_iterable(value)) if set(map(type, value)) <= {list} else None
    if flat is None or not set(map(type, flat)) <= {int}:  # bools and floats too
        token = next(
            t for t, row in enumerate(value) if type(row) is not list or {*map(type, row)} - {int}
        )
        raise WireFormatError(
            f"{what}[{token}]: expected lists of token ids (ints), found {value[token]!r:.60}"
        )
    try:
        ids = np.array(flat, np.int64) if flat else np.empty(0, np.int64)
    except OverflowError:  # an id past int64: name it as check_csr names one past int32
        token, found = next(
            (t, i) for t, row in enumerate(value) for i in row if not -(1 << 63) <= i < 1 << 63
        )
        raise WireFormatError(
            f"{what}[{token}]: expected token ids in [0, {MAX_TOKEN_ID}], found {found}"
        ) from None
    ids, counts = check_csr(ids, np.fromiter(map(len, value), np.int64, len(value)), what=what)
    return InlineRows(field, RaggedRows.from_lengths(ids, counts, what=what), prompt, meta)


def sources_of(choices: list[Any]) -> list[Any]:
    """Every source of ``choices`` (:class:`~.base.ChoiceRows`), in order; a field the
    producer sent as null is a :class:`WireFormatError` (the decoders' entry points)."""
    out: list[Any] = []
    for choice in choices:
        if choice.missing:
            raise WireFormatError(
                f"{choice.missing[0]}: no rows (null or absent); was the request sent with them "
                f"enabled?"
            )
        out.extend(choice.sources)
    return out


# --- synthesised bodies ---------------------------------------------------------------------


def array_base64(array: np.ndarray) -> str:
    """Base64 of an array's bytes in C order, as the producers write their blobs."""
    return pybase64.b64encode_as_string(np.ascontiguousarray(array))


def openai_usage(request: EngineRequest) -> dict[str, int]:
    """The OpenAI ``usage`` of a request, in the field order vLLM's and SGLang's servers send."""
    return {
        "prompt_tokens": request.prompt_len,
        "total_tokens": request.prompt_len + request.completion_len,
        "completion_tokens": request.completion_len,
    }
