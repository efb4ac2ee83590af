"""Parse a JSON body whose big base64 blobs never become Python strings.

A response carrying routes is mostly base64 (a 120 MiB body can hold 90 MiB of routes).
``orjson.loads`` on it would build one huge ``str`` per blob, then decoding copies it again.
:func:`load_packed_body` instead finds every registered field's blob in the raw bytes and
decodes it into its final buffer on the way to its closing quote (one pass over its
characters: a chunk that decodes holds no quote, so only the chunk where the decoder stops is
searched; a field's first blob in a body, or one after blobs under 64 KiB only, is searched
for and then decoded, as the buffer is sized by the field's largest blob before), parses the
body with each blob replaced by an integer placeholder (a 16-digit base, drawn at random per
process and fresh for each body, plus the blob's index: no value in a body can know it), then
checks every decoded blob against the shape and dtype its envelope claims. Nothing is sized by
a claim: the decoded blobs are 3/4 of their base64, and the spliced copy is the rest of the
body.

What a registered field's value may be:

- ``null``: left as ``None``;
- a bare base64 string (vLLM's ``.npy`` file, SGLang's flat int32): becomes the decoded
  ``bytearray``, for the producer to interpret;
- an envelope ``{"data": "<base64>", "shape": [...], "dtype": name, ...sidecar}`` with
  ``data`` first: stays a dict whose ``data`` is the decoded, writable ``np.ndarray``;
- a group of envelopes such as a CSR mask ``{"ids": <envelope>, "counts": <envelope>}``
  (the first member's value is an object or null): each member envelope is decoded as above.

With ``decode=False`` nothing is decoded: each blob becomes a :class:`~r3data.wire.blob.Blob`
(a view of its characters in an immutable copy of ``raw`` when ``raw`` can change), which the
loader decodes once, straight into the batch buffer; an envelope's claimed size is still
checked against the blob's length.

Registered keys are found by one regular-expression pass over the bytes outside the blobs,
however many fields are registered. A key counts only where JSON allows a key (after ``{`` or
``,``), so a string value that mentions a field, a key that merely ends with a field's name,
or an escaped quote never matches. Registered keys nested inside a registered value (an
envelope's sidecar) are left as parsed, and so is the value of a key written with escapes
(``"routed\\u005fexperts"``), which the byte scan does not see.

What cannot be spliced raises :class:`~r3data.errors.WireFormatError` naming the field and
byte offset: an envelope without ``data`` first, an unterminated blob, a blob with escapes
(``\\/``), invalid base64, invalid JSON, or a shape or dtype its blob does not match. These
are deterministic; only the transport that produced the bytes is worth retrying.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import re
import secrets
from collections.abc import Callable, Iterable
from functools import cache, lru_cache
from typing import Any, NamedTuple

import numpy as np
import orjson

from r3data.errors import ConfigError, WireFormatError
from r3data.wire.blob import Blob, decode_base64_into, decoded_length, direct_decoder
from r3data.wire.dtypes import DTypeLike
from r3data.wire.envelope import array_from_buffer, check_nbytes, envelope_spec

__all__ = ["load_packed_body"]

_WHITESPACE = b" \t\r\n"
_BACKSLASH = ord("\\")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|[^"\[\]{}]+', re.DOTALL)
_OPENERS = b"[{"
_CONTAINERS = frozenset({dict, list})
_QUOTE = ord('"')
AHEAD_GROUPS = 1 << 18
"""Base64 groups (4 characters) decoded at a time on the way to a blob's closing quote."""
AHEAD_MIN = 64 << 10
"""Decoded bytes of the previous blob from which the next is decoded ahead of its quote (a
smaller one goes the plain way: find the quote, then decode, in fewer calls)."""


_BASES = itertools.count(secrets.randbelow(9 * 10**15) + 10**15, 10**6)
"""Placeholder bases: random per process, a fresh one per body (nothing in a body can know it)."""


class _Blob(NamedTuple):
    """The base64 blob of ``field`` at ``raw[start:end]`` (between quotes): a :class:`Blob` view
    of its characters, replaced by its decoded bytes when the body is decoded; ``bare`` when it
    is a field's whole value (not an envelope's ``data``)."""

    field: str
    start: int
    end: int
    decoded: bytearray | np.ndarray | Blob
    bare: bool


@lru_cache(maxsize=64)
def _key_pattern(fields: tuple[str, ...]) -> re.Pattern[bytes]:
    names = []
    for name in fields:
        if not isinstance(name, str) or not name or orjson.dumps(name)[1:-1] != name.encode():
            raise ConfigError(
                f"load_packed_body fields: expected non-empty names that JSON writes without "
                f"escapes, found {name!r}"
            )
        names.append(re.escape(name.encode()))
    names.sort(key=len, reverse=True)
    return re.compile(rb'"(' + b"|".join(names) + rb')"[ \t\r\n]*:[ \t\r\n]*')


def _skip_whitespace(raw: bytes, pos: int) -> int:
    while pos < len(raw) and raw[pos] in _WHITESPACE:
        pos += 1
    return pos


def _is_key_position(raw: bytes, quote: int) -> bool:
    """True when the quote at ``quote`` follows ``{`` or ``,`` (whitespace aside)."""
    pos = quote - 1
    while pos >= 0 and raw[pos] in _WHITESPACE:
        pos -= 1
    return pos >= 0 and raw[pos] in b"{,"


def _decoded(direct: Callable[..., int], source: int, groups: int, target: int) -> bool:
    """Whether ``groups`` whole groups of base64 at address ``source`` decode to ``target``."""
    got = ctypes.c_size_t()
    return direct(source, 4 * groups, target, ctypes.byref(got), 0) == 1 and got.value == 3 * groups


@cache
def _memchr() -> Callable[..., int | None] | None:
    """The C library's ``memchr``, or None where ctypes cannot find it."""
    try:
        function = ctypes.CDLL(None).memchr
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    function.restype = ctypes.c_void_p
    return function


@cache
def _new_bytearray() -> Callable[[int], bytearray]:
    """A maker of ``bytearray(size)`` whose bytes are left as allocated (CPython's
    ``PyByteArray_FromStringAndSize(NULL, size)``), for buffers the decoder fills whole:
    ``bytearray(size)`` zeroes them first, which for an ahead buffer sized by a much larger
    blob before is most of a small blob's cost. Plain ``bytearray`` where ctypes lacks it."""
    try:
        function = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:
        return bytearray
    function.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    function.restype = ctypes.py_object
    return lambda size: function(None, size)


def _found(raw: bytes, pos: int) -> str:
    return repr(bytes(raw[pos : pos + 24])) if pos < len(raw) else "end of body"


class _Scanner:
    """Finds the blobs of registered fields in ``raw`` (see the module docstring)."""

    def __init__(self, raw: bytes, pattern: re.Pattern[bytes], decode: bool) -> None:
        self.raw = raw
        self.pattern = pattern
        self.decode = decode
        self.blobs: list[_Blob] = []
        self.largest: dict[str, int] = {}  # a field's largest decoded blob: its next buffer
        self._bytes: np.ndarray | None = None  # raw's bytes, for their address

    def _ahead(
        self, field: str, start: int, bare: bool
    ) -> tuple[int, int, bytearray | np.ndarray | None]:
        """Find the closing quote of the blob at ``start``, decoding the blob on the way (one
        pass over its characters, not a search and then a decode): the quote's offset (-1:
        none), the bytes decoded and the buffer they are in (None: nothing decoded).

        The buffer is the size of the field's largest blob before, or what the rest of the body
        could decode to if less (not sized by a claim), its bytes left as allocated. A chunk
        of characters that decodes whole holds no quote (a quote is not base64), so only the
        chunk where the decoder stops is searched for it: every character before the quote is
        still looked at. The blob's last group (which may be padded), whatever does not fit the
        buffer, and everything from a character the decoder refuses are left to
        :func:`decode_base64_into`, which checks and names them as it always does.
        """
        if (
            # no more than the rest of the body could hold
            (guess := min(self.largest.get(field, 0), (len(self.raw) - start) // 4 * 3)) < AHEAD_MIN
            or (memchr := _memchr()) is None
            or (direct := direct_decoder()) is None
        ):
            return self.raw.find(b'"', start), 0, None
        if self._bytes is None:
            self._bytes = np.frombuffer(self.raw, np.uint8)
        base = self._bytes.ctypes.data
        buffer = _new_bytearray()(guess) if bare else np.empty(guess, np.uint8)
        target = (np.frombuffer(buffer, np.uint8) if bare else buffer).ctypes.data
        limit = start + guess // 3 * 4  # the characters whose groups fit the buffer
        pos, end, done, decoding = start, -1, 0, True
        got = ctypes.c_size_t()
        while end < 0 and pos < len(self.raw):
            chunk = min(4 * AHEAD_GROUPS, len(self.raw) - pos)
            count = min(chunk, limit - pos) // 4 * 4 if decoding else 0
            clean = 0  # characters from ``pos`` that decoded, so hold no quote
            if count > 0:
                got.value = 0
                if direct(base + pos, count, target + done, ctypes.byref(got), 0) == 1:
                    clean = count if got.value == count // 4 * 3 else 0
                done += got.value if clean else 0
            if clean < chunk and (found := memchr(base + pos + clean, _QUOTE, chunk - clean)):
                end = found - base
            if count > 0 and not clean:  # the decoder stopped in this chunk
                decoding = False
                # the groups before the quote's last, of those the buffer holds (libbase64 may
                # write anywhere in 3/4 of the characters it is given, even where it stops)
                whole = min((end - pos) // 4 - 1, count // 4) if end >= 0 else 0
                if whole > 0 and (
                    got.value >= 3 * whole  # it stopped at the last group: those are in
                    or _decoded(direct, base + pos, whole, target + done)
                ):
                    done += 3 * whole
            pos += chunk
        return end, done, buffer

    @staticmethod
    def _fit(
        buffer: bytearray | np.ndarray | None, done: int, size: int, bare: bool
    ) -> bytearray | np.ndarray:
        """A buffer of ``size`` bytes whose first ``done`` are those of ``buffer``."""
        if buffer is not None and len(buffer) >= size:
            if not bare:
                buffer.resize(size, refcheck=False)  # in place; nothing else refers to it
                return buffer
            del buffer[size:]  # a small cut keeps the allocation: then a copy of the right size
            return buffer if buffer.__alloc__() <= size + 1 else bytearray(buffer)
        fitted = _new_bytearray()(size) if bare else np.empty(size, np.uint8)
        if done:
            memoryview(fitted)[:done] = memoryview(buffer)[:done]
        return fitted

    def scan(self) -> list[_Blob]:
        pos = 0
        try:
            while (match := self.pattern.search(self.raw, pos)) is not None:
                if _is_key_position(self.raw, match.start()):
                    pos = self._value(match.group(1).decode(), match.end())
                else:
                    pos = match.start() + 1
        finally:
            self._bytes = None  # a bytearray or mmap body may be resized or closed again
        return self.blobs

    def _blob(self, field: str, quote: int, *, bare: bool = False) -> int:
        if self.decode:
            end, done, buffer = self._ahead(field, quote + 1, bare)
        else:
            end, done, buffer = self.raw.find(b'"', quote + 1), 0, None
        if end < 0:
            raise WireFormatError(
                f"field {field!r}: unterminated base64 string starting at byte {quote} "
                f"of a {len(self.raw)}-byte body"
            )
        what = f"field {field!r} base64 string at byte {quote}"
        if self.raw[end - 1] == _BACKSLASH:  # an escaped quote, or an escaped backslash
            raise WireFormatError(
                f"{what}: expected base64 characters up to the closing quote, found an escape "
                f"at byte {end - 1}"
            )
        chars = memoryview(self.raw)[quote + 1 : end]
        size = decoded_length(chars, what)
        decoded: bytearray | np.ndarray | Blob = Blob(chars, what)
        if self.decode:  # now, while the characters are in cache, into a buffer of its own
            decoded = self._fit(buffer, done, size, bare)
            target = np.frombuffer(decoded, np.uint8) if bare else decoded
            try:
                decode_base64_into(chars, target[done:], skip=done, what=what)
            except WireFormatError:
                if not done:
                    raise
                decode_base64_into(chars, target, what=what)  # raises naming what it always has
            self.largest[field] = max(self.largest.get(field, 0), size)
        self.blobs.append(_Blob(field, quote + 1, end, decoded, bare))
        return end + 1

    def _value(self, field: str, pos: int) -> int:
        head = self.raw[pos : pos + 1]
        if head == b'"':
            return self._blob(field, pos, bare=True)
        if head == b"{":
            return self._object(field, pos)
        if self.raw[pos : pos + 4] == b"null":
            return pos + 4
        raise WireFormatError(
            f"field {field!r} at byte {pos}: expected a base64 string, an envelope object or "
            f"null, found {_found(self.raw, pos)}"
        )

    def _key(self, field: str, pos: int) -> tuple[bytes | None, int]:
        """Read ``"key":`` at ``pos``; ``(None, pos)`` at a closing brace."""
        pos = _skip_whitespace(self.raw, pos)
        if self.raw[pos : pos + 1] == b"}":
            return None, pos
        match = _STRING.match(self.raw, pos)
        if match is None:
            raise WireFormatError(
                f"field {field!r} at byte {pos}: expected a key, found {_found(self.raw, pos)}"
            )
        colon = _skip_whitespace(self.raw, match.end())
        if self.raw[colon : colon + 1] != b":":
            raise WireFormatError(
                f"field {field!r} at byte {colon}: expected ':', found {_found(self.raw, colon)}"
            )
        return match.group(), _skip_whitespace(self.raw, colon + 1)

    def _object(self, field: str, brace: int) -> int:
        key, pos = self._key(field, brace + 1)
        if key == b'"data"':
            return self._envelope_rest(field, pos)
        if key is not None and (
            self.raw[pos : pos + 1] == b"{" or self.raw[pos : pos + 4] == b"null"
        ):
            return self._group(field, key, pos)
        raise WireFormatError(
            f"field {field!r} at byte {brace}: expected an envelope with 'data' as its first "
            f"key (or an object of envelopes), found "
            f"{'an empty object' if key is None else 'first key ' + key.decode(errors='replace')}"
        )

    def _envelope_rest(self, field: str, pos: int) -> int:
        """Splice the blob at ``pos`` (after ``"data":``) and skip the rest of its envelope."""
        if self.raw[pos : pos + 1] != b'"':
            raise WireFormatError(
                f"field {field!r} at byte {pos}: expected 'data' to be a base64 string, "
                f"found {_found(self.raw, pos)}"
            )
        return self._close(field, self._blob(field, pos))

    def _group(self, field: str, key: bytes, pos: int) -> int:
        while True:
            member = f"{field}.{key.decode(errors='replace')[1:-1]}"
            if self.raw[pos : pos + 4] == b"null":
                pos += 4
            elif (
                self.raw[pos : pos + 1] == b"{"
                and (inner := self._key(member, pos + 1))[0] == b'"data"'
            ):
                pos = self._envelope_rest(member, inner[1])
            else:
                raise WireFormatError(
                    f"field {member!r} at byte {pos}: expected an envelope with 'data' first "
                    f"or null, found {_found(self.raw, pos)}"
                )
            pos = _skip_whitespace(self.raw, pos)
            if self.raw[pos : pos + 1] == b"}":
                return pos + 1
            if self.raw[pos : pos + 1] != b",":
                raise WireFormatError(
                    f"field {field!r} at byte {pos}: expected ',' or '}}' between envelopes, "
                    f"found {_found(self.raw, pos)}"
                )
            key, pos = self._key(field, pos + 1)
            if key is None:
                raise WireFormatError(f"field {field!r} at byte {pos}: trailing ',' in object")

    def _close(self, field: str, pos: int) -> int:
        """Skip to just past the ``}`` closing the object that ``pos`` is inside."""
        depth = 1
        while depth:
            match = _TOKEN.match(self.raw, pos)
            if match is None:
                raise WireFormatError(
                    f"field {field!r}: unterminated envelope, found {_found(self.raw, pos)} "
                    f"at byte {pos}"
                )
            head = self.raw[pos]
            if head in _OPENERS:
                depth += 1
            elif head in b"]}":
                depth -= 1
            pos = match.end()
        return pos


def _splice(raw: bytes, blobs: list[_Blob], base: int) -> bytes:
    """The body with blob ``i`` (quotes included) replaced by ``base + i``."""
    parts: list[bytes | memoryview] = []
    prev = 0
    with memoryview(raw) as view:
        for index, blob in enumerate(blobs):
            parts += (view[prev : blob.start - 1], b"%d" % (base + index))
            prev = blob.end + 1
        parts += (view[prev:],)
        spliced = b"".join(parts)
        parts.clear()
    return spliced


def _part_offsets(blobs: list[_Blob], base: int) -> tuple[list[int], list[int]]:
    """Where each part of :func:`_splice`'s body starts in it and in the raw body (to name a
    byte of the raw body in a JSON error)."""
    spliced_at: list[int] = []
    raw_at: list[int] = []
    size = prev = 0
    for index, blob in enumerate(blobs):
        spliced_at.append(size)
        raw_at.append(prev)
        size += blob.start - 1 - prev + len(b"%d" % (base + index))
        prev = blob.end + 1
    spliced_at.append(size)
    raw_at.append(prev)
    return spliced_at, raw_at


def _parse(raw: bytes, blobs: list[_Blob], base: int) -> Any:
    try:
        return orjson.loads(_splice(raw, blobs, base))
    except orjson.JSONDecodeError as err:
        spliced_at, raw_at = _part_offsets(blobs, base)
        part = bisect.bisect_right(spliced_at, err.pos) - 1
        offset = raw_at[part] + err.pos - spliced_at[part]
        raise WireFormatError(
            f"body: invalid JSON near byte {offset} of {len(raw)} ({err.msg})"
        ) from None


class _Resolver:
    """Puts every decoded blob where its placeholder landed, each exactly once."""

    def __init__(self, blobs: list[_Blob], base: int, allowed: Iterable[DTypeLike] | None) -> None:
        self.blobs = blobs
        self.base = base
        self.allowed = allowed
        self.claimed = bytearray(len(blobs))
        self.unclaimed = len(blobs)

    def _claim(self, value: object) -> _Blob | None:
        """The blob whose placeholder ``value`` is, claimed; ``None`` for any other value."""
        index = value - self.base if type(value) is int else -1
        if not 0 <= index < len(self.blobs) or self.claimed[index]:
            return None
        self.claimed[index] = 1
        self.unclaimed -= 1
        return self.blobs[index]

    def _envelope(self, envelope: object) -> bool:
        """Decode ``envelope`` if it is a spliced one; ``False`` if not."""
        if type(envelope) is not dict or (blob := self._claim(envelope.get("data"))) is None:
            return False
        what = f"field {blob.field!r} envelope at byte {blob.start - 1}"
        dtype, shape, _ = envelope_spec(envelope, allowed_dtypes=self.allowed, what=what)
        if isinstance(blob.decoded, Blob):
            check_nbytes(decoded_length(blob.decoded.chars), dtype, shape, what=what)
            envelope["data"] = blob.decoded
        else:
            envelope["data"] = array_from_buffer(blob.decoded, dtype, shape, what=what)
        return True

    def _resolve(self, node: dict[str, Any], field: str) -> list[Any]:
        """Place the blob(s) of the registered key ``field``; returns the containers under it
        still to walk (a value the scan did not splice, e.g. under an escaped key)."""
        value = node[field]
        if (blob := self._claim(value)) is not None:
            node[field] = blob.decoded
            return []
        if type(value) is list:
            return [value]
        if type(value) is not dict or self._envelope(value):
            return []
        for member in value.values():  # a group of envelopes, or a value left as parsed
            self._envelope(member)
        return [value]

    def walk(self, root: Any, fields: frozenset[str]) -> None:
        """Resolve the registered keys in ``root``, objects before lists, stopping once every
        blob is placed (so long lists of numbers are usually never visited)."""
        objects = [root] if type(root) is dict else []
        lists = [root] if type(root) is list else []
        while self.unclaimed and (objects or lists):
            if objects:
                node = objects.pop()
                for key, value in node.items():
                    if key in fields:
                        for inner in self._resolve(node, key):
                            (objects if type(inner) is dict else lists).append(inner)
                    elif type(value) is dict:
                        objects.append(value)
                    elif type(value) is list:
                        lists.append(value)
            else:
                items = lists.pop()
                if not _CONTAINERS.isdisjoint(map(type, items)):
                    for item in items:
                        if type(item) is dict:
                            objects.append(item)
                        elif type(item) is list:
                            lists.append(item)
        if self.unclaimed:
            lost = self.blobs[self.claimed.index(0)]
            raise WireFormatError(
                f"field {lost.field!r}: blob at byte {lost.start - 1} is missing from the "
                f"parsed body (duplicate key?)"
            )


def load_packed_body(
    raw: bytes | bytearray | memoryview | mmap.mmap,
    fields: Iterable[str] = ("routed_experts",),
    *,
    allowed_dtypes: Iterable[DTypeLike] | None = None,
    decode: bool = True,
) -> Any:
    """Parse JSON ``raw`` with every ``fields`` value decoded in one pass (see module doc).

    ``allowed_dtypes`` narrows the dtypes envelopes may use (default: any wire dtype);
    ``decode=False`` leaves every blob as a :class:`~r3data.wire.blob.Blob`, a view into the
    body, so a body that can change (``bytearray``, ``mmap``, ``memoryview``) is first copied
    once to ``bytes``: a receive buffer reused for the next response must not change the
    routes of this one. With ``decode=True`` a ``bytearray`` or ``mmap`` is read in place (every
    blob is decoded into a buffer of its own) and only a ``memoryview`` is copied.
    """
    if type(raw) is not bytes:
        if not isinstance(raw, bytes | bytearray | memoryview | mmap.mmap):
            raise WireFormatError(
                f"body: expected bytes, bytearray, memoryview or mmap, found {type(raw).__name__}"
            )
        if isinstance(raw, memoryview):
            raw = raw.tobytes()
        elif not decode:
            raw = bytes(raw)
    names = tuple(fields)
    if not names:
        raise ConfigError("load_packed_body fields: expected at least one field name")
    blobs = _Scanner(raw, _key_pattern(names), decode).scan()
    base = next(_BASES)
    root = _parse(raw, blobs, base)
    _Resolver(blobs, base, allowed_dtypes).walk(root, frozenset(names))
    return root
