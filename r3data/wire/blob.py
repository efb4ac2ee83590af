"""Base64 blobs: strict decoding, whole or a byte range straight into a caller's buffer.

Every producer sends its bulk rows as padded base64 (RFC 4648, no line breaks). The decoded
size is known from the length alone, so every claim is checked before anything is allocated,
and :func:`decode_base64_into` writes a byte range of the decoded blob into its final place,
chunk by chunk, the bytes still in cache when the caller screens them. The chunks decode
straight into the destination with the SIMD decoder pybase64 is built on (libbase64's
``base64_decode``, which its extension exports; the GIL is released for the call); the one
group at either end that the range cuts or that holds padding goes through pybase64, and so
does a short range (up to 16 KiB, whose copy costs less than setting up the direct call) and
everything, a cache-sized bounce at a time, where that decoder is missing: never a temporary
of the blob's size. Padding anywhere but at the blob's end is refused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

import numpy as np
import pybase64

from r3data.errors import SegmentError, WireFormatError

__all__ = [
    "Base64Data",
    "Blob",
    "decode_base64",
    "decode_base64_into",
    "decoded_length",
    "destination_bytes",
    "direct_decoder",
]

Base64Data = str | bytes | bytearray | memoryview

_PAD = ord("=")
_PADDING = (_PAD, "=")
"""The padding character as a byte's item and as a str's."""
_DIRECT_KINDS = frozenset({str, bytes, bytearray})
_CHUNK_GROUPS = (1 << 20) // 3
"""Base64 groups (3 decoded bytes each) per bounce: about 1 MiB, L2-sized."""
_SMALL_RANGE = 16 << 10
"""Decoded bytes up to which a range goes through one bounce: below this, the direct call's
fixed cost (pointers, ctypes arguments: several microseconds) is more than the copy."""


class Blob(NamedTuple):
    """A base64 blob not yet decoded: ``chars``, a view of its characters in the raw body, and
    ``what`` names it in messages (field and byte offset)."""

    chars: memoryview
    what: str


@cache
def direct_decoder() -> Callable[..., int] | None:
    """libbase64's ``base64_decode(src, srclen, out, &outlen, flags)`` from pybase64's own
    extension (1: decoded, 0: invalid input; ``outlen``: the bytes written, which it also sets
    when it refuses), or None when this build does not export it."""
    try:
        function = ctypes.CDLL(pybase64._pybase64.__file__).base64_decode
    except (AttributeError, OSError):
        return None
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_int,
    ]
    function.restype = ctypes.c_int
    return function


def byte_view(view: memoryview, what: str) -> memoryview:
    """``view`` as a view of its bytes (any item format); refused when not contiguous."""
    try:
        return view.cast("B")
    except TypeError as err:
        raise WireFormatError(f"{what}: buffer is not contiguous ({err})") from None


def as_base64_buffer(data: object, what: str) -> Base64Data:
    """``data`` as something pybase64 decodes: str, bytes, bytearray or a byte memoryview."""
    if type(data) in _DIRECT_KINDS or isinstance(data, str | bytes | bytearray):
        return data
    if isinstance(data, memoryview):
        return byte_view(data, what)
    raise WireFormatError(
        f"{what}: expected base64 as str, bytes, bytearray or memoryview, "
        f"found {type(data).__name__}"
    )


def decoded_length(data: Base64Data, what: str = "data") -> int:
    """Bytes that padded base64 ``data`` decodes to, computed from its length alone."""
    size = len(data)
    if size % 4:
        raise WireFormatError(
            f"{what}: base64 must be padded to a multiple of 4 characters, found {size}"
        )
    if not size or data[-1] not in _PADDING:  # a str's characters, or bytes as ints
        return size // 4 * 3
    return size // 4 * 3 - 1 - (data[-2] in _PADDING)


def _decode(chunk: Base64Data, what: str, at: int) -> bytes:
    try:
        return pybase64.b64decode(chunk, validate=True)
    except (ValueError, TypeError) as err:
        raise WireFormatError(
            f"{what}: invalid base64 in characters [{at}, {at + len(chunk)}) ({err})"
        ) from None


def decode_base64(
    data: object, *, expected_nbytes: int | None = None, what: str = "data"
) -> bytearray:
    """Strictly decode padded base64 into a new (writable) ``bytearray``.

    When ``expected_nbytes`` is given, the decoded size (known from the length) must match it
    before anything is decoded. A ``str`` is decoded in place, never copied to another string.
    """
    buffer = as_base64_buffer(data, what)
    nbytes = decoded_length(buffer, what)
    if expected_nbytes is not None and nbytes != expected_nbytes:
        raise WireFormatError(
            f"{what}: expected {expected_nbytes} bytes, found base64 of {len(buffer)} "
            f"characters that decodes to {nbytes} bytes"
        )
    try:
        decoded = pybase64.b64decode_as_bytearray(buffer, validate=True)
    except (ValueError, TypeError) as err:
        raise WireFormatError(
            f"{what}: invalid base64 in {len(buffer)} characters ({err})"
        ) from None
    if len(decoded) != nbytes:
        raise WireFormatError(
            f"{what}: expected base64 decoding to {nbytes} bytes, found {len(decoded)}"
        )
    return decoded


def destination_bytes(dest: np.ndarray, what: str) -> np.ndarray:
    """The bytes of ``dest`` as a flat uint8 view, refused unless ``dest`` is writable and
    C-contiguous (anything else would be written through a copy, or past its elements)."""
    flags = dest.flags
    if not (flags.c_contiguous and flags.writeable):
        raise SegmentError(
            f"{what}: expected a writable C-contiguous destination, found contiguous="
            f"{flags.c_contiguous} writeable={flags.writeable}"
        )
    return dest.reshape(-1).view(np.uint8)


def decode_base64_into(
    data: Base64Data,
    dest: np.ndarray,
    *,
    skip: int = 0,
    what: str = "data",
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Decode bytes ``[skip, skip + dest.nbytes)`` of base64 ``data`` into ``dest`` (a
    writable C-contiguous array), chunk by chunk; the range must lie inside the blob.
    ``on_bytes(done)`` is told after each chunk how many leading bytes of ``dest`` are in."""
    out = destination_bytes(dest, what)
    nbytes = out.size
    if not isinstance(data, str):
        try:
            data = memoryview(data).cast("B")  # slices below are views, not copies
        except TypeError:
            data = as_base64_buffer(data, what)  # raises the typed error naming what it is
    total = decoded_length(data, what)
    if skip < 0 or skip + nbytes > total:
        raise WireFormatError(
            f"{what}: expected bytes [{skip}, {skip + nbytes}) inside the {total} the base64 "
            f"decodes to"
        )
    group = skip // 3
    drop = skip - 3 * group  # decoded bytes of the first group before the range
    small = nbytes + drop <= _SMALL_RANGE
    direct = None if small or isinstance(data, str) else direct_decoder()
    if direct is not None:
        source = np.frombuffer(data, np.uint8).ctypes.data
        target = out.ctypes.data
        got = ctypes.c_size_t()
    written = 0
    while written < nbytes:
        remaining = nbytes - written
        # Whole groups, none padded, whose every decoded byte is the caller's: straight in.
        whole = min(_CHUNK_GROUPS, remaining // 3) if direct is not None and drop == 0 else 0
        if whole and data[4 * (group + whole) - 1] == _PAD:
            whole -= 1
        if whole:
            at = 4 * group
            ok = direct(source + at, 4 * whole, target + written, ctypes.byref(got), 0)
            if ok != 1 or got.value != 3 * whole:
                raise WireFormatError(
                    f"{what}: invalid base64 in characters [{at}, {at + 4 * whole})"
                )
            take, groups = 3 * whole, whole
        else:  # a group cut by the range or padded (or no direct decoder): through a bounce
            groups = 1 if direct is not None else min(_CHUNK_GROUPS, -(-(remaining + drop) // 3))
            at = 4 * group
            piece = _decode(data[at : at + 4 * groups], what, at)
            if len(piece) < 3 * groups and at + 4 * groups < len(data):
                raise WireFormatError(
                    f"{what}: invalid base64 in characters [{at}, {at + 4 * groups}) (padding "
                    f"before the end)"
                )
            take = min(len(piece) - drop, remaining)
            out[written : written + take] = np.frombuffer(piece, np.uint8, take, drop)
        written += take
        group += groups
        drop = 0
        if on_bytes is not None:
            on_bytes(written)
