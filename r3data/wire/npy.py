"""The ``.npy`` header vLLM's routes carry (``np.save`` of ``[rows, layers, topk]``), read strictly.

``np.save`` writes ``\\x93NUMPY``, a version, the header length, then a dict literal in one
canonical form, ``{'descr': '<u1', 'fortran_order': False, 'shape': (5, 48, 8), }``, padded
with spaces to a 64-byte boundary and ended by a newline. That form is matched exactly (no
``ast``, nothing evaluated); any other header is refused as a :class:`WireFormatError` naming
what was found.
"""

from __future__ import annotations

import re
import struct
from functools import lru_cache

import numpy as np

from r3data.errors import WireFormatError
from r3data.wire.dtypes import DTypeLike, parse_dtype

__all__ = ["NPY_PREFIX_BYTES", "npy_header_length", "parse_npy_header"]

_MAGIC = b"\x93NUMPY"
NPY_PREFIX_BYTES = 12
"""Bytes that always hold the magic, the version and the header length."""
_MAX_HEADER = 10_000  # numpy's own limit on a header it will read
_HEADER = re.compile(
    rb"\{'descr': *'([^'\\]{1,32})', *'fortran_order': *(False|True), *"
    rb"'shape': *\(((?:[0-9]{1,19}, *)*[0-9]{0,19})\), *\} *\n"
)


def npy_header_length(prefix: bytes, what: str) -> int:
    """Bytes from the start of the file to its data: the magic, version and length fields
    plus the header they announce (read from the first :data:`NPY_PREFIX_BYTES` or more)."""
    if len(prefix) < 10 or not prefix.startswith(_MAGIC):
        raise WireFormatError(
            f"{what}: expected a .npy file starting with {_MAGIC!r}, found {bytes(prefix[:8])!r}"
        )
    major = prefix[6]
    if major == 1:
        (size,) = struct.unpack_from("<H", prefix, 8)
        start = 10
    elif major in (2, 3):
        if len(prefix) < 12:
            raise WireFormatError(
                f"{what}: expected a .npy file of version {major}.{prefix[7]} of at least 12 "
                f"bytes, found {len(prefix)}"
            )
        (size,) = struct.unpack_from("<I", prefix, 8)
        start = 12
    else:
        raise WireFormatError(
            f"{what}: expected a .npy file of format version 1, 2 or 3, found {major}.{prefix[7]}"
        )
    if size > _MAX_HEADER:
        raise WireFormatError(
            f"{what}: expected a .npy file with a header of at most {_MAX_HEADER} bytes, "
            f"found {size}"
        )
    return start + size


def parse_npy_header(
    head: bytes | bytearray, what: str, allowed: tuple[DTypeLike, ...] | None = None
) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """``(dtype, shape, fortran_order, data_offset)`` of the ``.npy`` file whose first bytes
    are ``head`` (at least :func:`npy_header_length` of them)."""
    offset = npy_header_length(head, what)
    if len(head) < offset:
        raise WireFormatError(
            f"{what}: expected a .npy file with a header of {offset} bytes, found {len(head)} "
            f"bytes in all"
        )
    start = 10 if head[6] == 1 else 12
    match = _HEADER.fullmatch(head, start, offset)
    if match is None:
        raise WireFormatError(
            f"{what}: expected a .npy file whose header is as np.save writes it "
            f"({{'descr': ..., 'fortran_order': False, 'shape': (rows, layers, topk), }}), "
            f"found {bytes(head[start:offset][:120])!r}"
        )
    descr, fortran, dims = match.groups()
    extents = dims.split(b",")  # only the last can be blank: "(7,)" or "()"
    if not extents[-1].strip():
        extents.pop()
    try:
        dtype = _descr_dtype(descr, allowed)
    except WireFormatError as err:
        raise WireFormatError(f"{what}: .npy header descr: {err}") from None
    return dtype, tuple(map(int, extents)), fortran == b"True", offset


@lru_cache(maxsize=64)
def _descr_dtype(descr: bytes, allowed: tuple[DTypeLike, ...] | None) -> np.dtype:
    """The dtype a header's ``descr`` names (headers of a run repeat a few)."""
    return parse_dtype(descr.decode("latin-1"), allowed)
