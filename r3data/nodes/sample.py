"""``RolloutSample``: one training sample as the loader sees it, from a dict or a dataclass.

A sample carries token ids, a loss mask and the route sources of its trace. Sources come as
a ready ``Trace``/``TraceBuilder`` or as ``requests``: one entry per inference request,
``{"prompt_len", "completion_len", "sources": [...]}``, where each source is an
``InlineRows`` or ``EncodedRows``, a ``PayloadSegment``, a segment dict (prime-rl's by-handle
``payload`` entries), or a producer response ``{"producer": name, "response": raw bytes or
parsed body, **options}`` with ``name`` a format of :data:`r3data.wire.producers.FORMATS`
and its typed options (``choice``, ``start``, ``role``, ...).
"""

from __future__ import annotations

import dataclasses
import mmap
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3data.errors import R3DataError, TraceError, with_message
from r3data.nodes.options import TraceOptions
from r3data.trace import Trace, TraceBuilder
from r3data.trace.builder import FieldInfo, Source
from r3data.trace.stitch import NO_RAGGED_ROWS
from r3data.validate import INT64_MAX
from r3data.wire.producers import decode_source
from r3data.wire.rows import EncodedRows, InlineRows
from r3data.wire.segment import PayloadSegment


@dataclass(frozen=True, eq=False)
class RolloutSample:
    """What the loader needs of one sample (``len(token_ids)`` positions are trained on)."""

    sample_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    trace: Trace
    logprobs: np.ndarray | None = None
    files: tuple[str, ...] = ()
    """Payload files of every by-handle source (claimed for retention even when overridden)."""

    @property
    def sample_len(self) -> int:
        return int(self.token_ids.shape[0])


def _get(obj: Any, name: str, alias: str | None = None) -> Any:
    """``obj``'s ``name`` (or, when it has none, its ``alias``): a key of a mapping, else an
    attribute; None when it has neither."""
    if type(obj) is dict:  # the usual sample: no ABC check
        return obj.get(name if alias is None or name in obj else alias)
    mapping = isinstance(obj, Mapping)
    for key in (name,) if alias is None else (name, alias):
        if mapping:
            if key in obj:
                return obj[key]
        elif hasattr(obj, key):
            return getattr(obj, key)
    return None


_ALL_TRUE = np.ones(1, bool)
"""The loss mask of a sample without one is this, repeated (a new writable array)."""
_KINDS = {np.int64: "iu", bool: "biu", np.float32: "biuf"}
"""The dtype kinds each sample vector accepts."""


def _vector(name: str, value: Any, length: int | None, dtype: Any) -> np.ndarray:
    array = np.asarray(value)
    if not array.size and not isinstance(value, np.ndarray):
        array = array.astype(dtype)  # ``[]`` is float64 to numpy: no value is wrong in it
    kinds = _KINDS[dtype]
    kind = array.dtype.kind
    if kind not in kinds or (
        dtype is bool and kind in "iu" and array.size and (array.max() > 1 or array.min() < 0)
    ):
        expected = {"iu": "integers", "biu": "booleans or 0/1", "biuf": "numbers"}[kinds]
        found = ""
        if kind in "iu":
            found = f" with values up to {array.max()}" if array.max() > 1 else ""
            found = found or f" with values down to {array.min()}"
        raise TraceError(f"{name} must be {expected}, found dtype {array.dtype}{found}")
    if array.ndim != 1 or (length is not None and array.shape[0] != length):
        raise TraceError(f"{name} must be 1-D with {length} entries, found shape {array.shape}")
    if dtype is np.int64 and array.dtype == np.uint64 and array.size and array.max() > INT64_MAX:
        raise TraceError(f"{name} must be integers that fit int64, found {array.max()}")
    return array.astype(dtype, copy=False)


def source_rows(source: Any, *, prompt_len: int, completion_len: int) -> list[Source]:
    """Turn one request source into trace sources (decoding producer responses through the
    registry)."""
    mapping = type(source) is dict or isinstance(source, Mapping)
    if mapping and "file" in source:
        return [PayloadSegment.from_dict(source)]
    if mapping and "producer" in source:
        return decode_source(source, prompt_len=prompt_len, completion_len=completion_len)
    if isinstance(source, (InlineRows, EncodedRows, PayloadSegment)):
        return [source]
    raise TraceError(
        "a request source must be InlineRows, EncodedRows, a PayloadSegment, a segment dict with "
        f"'file' or a producer response with 'producer', found {type(source).__name__}"
    )


def _files(sources: Iterable[Any]) -> tuple[str, ...]:
    return tuple(sorted({s.file for s in sources if isinstance(s, PayloadSegment)}))


def _trace_of(
    obj: Any, sample_id: str, trace_options: TraceOptions
) -> tuple[Trace, tuple[str, ...]]:
    trace = _get(obj, "trace")
    if trace is not None:
        if isinstance(trace, TraceBuilder):
            trace = trace.build()
        if isinstance(trace, Trace):
            return trace, _files(p for pieces in trace.pieces.values() for p in pieces)
    requests = _get(obj, "requests")
    if requests is None:
        raise TraceError("expected a 'trace' or 'requests', found neither")
    builder = TraceBuilder(sample_id, **trace_options.builder_options)
    files: set[str] = set()
    for number, request in enumerate(_iterable(requests, "requests")):
        if not (
            (type(request) is dict or isinstance(request, Mapping))
            and "prompt_len" in request
            and "completion_len" in request
        ):
            raise TraceError(
                f"request {number}: expected a dict with 'prompt_len', 'completion_len' and "
                f"'sources', found {request!r:.80}"
            )
        prompt_len, completion_len = request["prompt_len"], request["completion_len"]
        sources: list[Source] = []
        for source in _iterable(request.get("sources", ()), "sources", number):
            sources += source_rows(source, prompt_len=prompt_len, completion_len=completion_len)
        builder.add_request(prompt_len, completion_len, sources)
        for row in sources:
            if isinstance(row, PayloadSegment):
                files.add(row.file)
    return builder.build(), tuple(sorted(files)) if files else ()


def _iterable(items: object, items_name: str, request: int | None = None) -> Iterable[Any]:
    """``items``, which a sample lists (its requests, or the sources of its ``request``th):
    anything iterable but a string, bytes or a number."""
    if type(items) is list:  # the usual sample: no ABC check
        return items
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        what = f"'{items_name}'" if request is None else f"request {request} '{items_name}'"
        raise TraceError(f"{what}: expected a list of {items_name}, found {type(items).__name__}")
    return items


def sample_id_of(obj: Any, index: int) -> str:
    """The sample's ``sample_id`` or ``id``, else its index."""
    for name in ("sample_id", "id"):
        value = _get(obj, name)
        if value is not None:
            return str(value)
    return str(index)


def sample_length(obj: Any) -> int:
    """Tokens of a raw sample (``len(token_ids)``) without normalising it; 0 when it has none
    (the stitch stage then reports what is wrong with it)."""
    if isinstance(obj, RolloutSample):
        return obj.sample_len
    tokens = _get(obj, "token_ids", "input_ids")
    try:
        return len(tokens)  # type: ignore[arg-type]
    except TypeError:
        return 0


def sample_files(obj: Any) -> tuple[str, ...]:
    """The payload files a raw sample names (by-handle segments, dicts with ``file``, a ready
    trace's pieces, producer responses by handle), decoding only responses that may name one;
    what is malformed is left to the stitch stage, which names it."""
    if isinstance(obj, RolloutSample):
        return obj.files
    trace = _get(obj, "trace")
    if isinstance(trace, TraceBuilder | Trace):
        pieces = (trace.build() if isinstance(trace, TraceBuilder) else trace).pieces
        return _files(p for field in pieces.values() for p in field)
    files: set[str] = set()
    requests = _get(obj, "requests")
    for request in _rereadable("requests", requests):
        sources = request.get("sources", ()) if isinstance(request, Mapping) else ()
        for source in _rereadable("a request's sources", sources):
            if isinstance(source, PayloadSegment):
                files.add(source.file)
            elif isinstance(source, Mapping) and isinstance(source.get("file"), str):
                files.add(source["file"])
            elif isinstance(source, Mapping) and "producer" in source:
                files.update(_response_files(source, request))
    return tuple(sorted(files))


def _rereadable(name: str, items: object) -> Sequence[Any]:
    """``items`` if it can be read again; ``()`` for what the stitch stage will refuse. An
    iterator would be used up here, or its files missed: either loses routes or a file."""
    if isinstance(items, Sequence) and not isinstance(items, str | bytes):
        return items
    if isinstance(items, Iterable) and not isinstance(items, str | bytes | Mapping):
        raise TraceError(
            f"{name}: expected a list or tuple (the retention scan reads every sample before "
            f"it is stitched), found {type(items).__name__}"
        )
    return ()


_FILE_KEY = re.compile(rb'"(?:f|\\u0066)(?:i|\\u0069)(?:l|\\u006[cC])(?:e|\\u0065)"')
"""A by-handle segment's key as JSON may spell it (each letter itself or its ``\\u`` escape,
which the parser reads alike); no base64 blob holds one (it has no quotes)."""


def _response_files(source: Mapping[str, Any], request: Mapping[str, Any]) -> list[str]:
    """The files a producer response names by handle (prime-rl's ``payload``), decoded only
    when the body may hold a segment: raw bodies without a ``"file"`` key, in any spelling, are
    not parsed (a spelling the scan missed would leave a file unclaimed, and deleted early)."""
    response = source.get("response")
    if isinstance(response, bytes | bytearray | memoryview | mmap.mmap) and not _FILE_KEY.search(
        response
    ):
        return []
    try:
        rows = decode_source(
            source,
            prompt_len=request.get("prompt_len"),
            completion_len=request.get("completion_len"),
        )
    except R3DataError:  # the stitch stage decodes it again and names what is wrong
        return []
    return [row.file for row in rows if isinstance(row, PayloadSegment)]


def name_sample(message: str, sample_id: str, index: int) -> str:
    """``message`` about one sample, naming it once: ``sample 'id' (index i): ...``.

    A message a lower layer already began with the sample (``sample 'id'``) or its trace
    (``trace 'id'``, the trace of the sample) gets the loader's name instead of a second one.
    """
    name = f"sample {sample_id!r} (index {index})"
    if message.startswith(name):
        return message
    for lead in (f"sample {sample_id!r}", f"trace {sample_id!r}"):
        if message.startswith(lead):
            message = message[len(lead) :].lstrip(":").lstrip()
            break
    return f"{name}: {message}"


def as_rollout(obj: Any, index: int, trace: TraceOptions | None = None) -> RolloutSample:
    """Normalise a dict or dataclass sample; ``index`` names it when it has no id. Errors keep
    their class and name the sample once: ``sample 'id' (index i): ...``."""
    if isinstance(obj, RolloutSample):
        return obj
    if not (type(obj) is dict or dataclasses.is_dataclass(obj) or isinstance(obj, Mapping)):
        raise TraceError(
            f"sample {str(index)!r} (index {index}): expected a dict or a dataclass, found "
            f"{type(obj).__name__}"
        )
    sample_id = sample_id_of(obj, index)
    try:
        return _rollout(obj, sample_id, trace or TraceOptions())
    except Exception as exc:
        raise with_message(exc, name_sample(str(exc), sample_id, index)) from exc


def _rollout(obj: Any, sample_id: str, trace: TraceOptions) -> RolloutSample:
    tokens = _get(obj, "token_ids", "input_ids")
    if tokens is None:
        raise TraceError("expected 'token_ids', found none")
    token_ids = _vector("token_ids", tokens, None, np.int64)
    n = token_ids.shape[0]
    loss_mask = _get(obj, "loss_mask")
    loss_mask = (
        _ALL_TRUE.repeat(n) if loss_mask is None else _vector("loss_mask", loss_mask, n, bool)
    )
    logprobs = _get(obj, "logprobs")
    if logprobs is not None:
        logprobs = _vector("logprobs", logprobs, n, np.float32)
    built, files = _trace_of(obj, sample_id, trace)
    return RolloutSample(sample_id, token_ids, loss_mask, built, logprobs, files)


def field_forms(
    samples: Iterable[tuple[int, Any]], fields: Sequence[str], trace: TraceOptions
) -> dict[str, FieldInfo]:
    """Each field's dtype, row shape and raggedness, from the first of ``(index, raw
    sample)`` whose trace has rows of it (a field none has is left out, unless it is ragged:
    empty int32 rows); no row is read or decoded. A micro-batch without a sample of its own
    takes its fields' form from its step: its forward still runs, with an empty route tensor
    per MoE layer. A sample that cannot be normalised is skipped here: the rank that owns it
    reports it."""
    forms: dict[str, FieldInfo] = {}
    for index, raw in samples:
        try:
            info = as_rollout(raw, index, trace).trace.info
        except R3DataError:
            continue
        forms.update((name, info[name]) for name in fields if name in info and name not in forms)
        if len(forms) == len(fields):
            break
    for name in fields:
        if name not in forms and name in trace.ragged_fields:
            forms[name] = NO_RAGGED_ROWS
    return forms
