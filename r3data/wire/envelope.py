"""Packed-array envelopes: ``{"data": <base64>, "shape": [...], "dtype": name, **sidecar}``.

``data`` is the array's little-endian bytes in C order, base64 with padding (RFC 4648, no line
breaks), and comes first so a reader can cut the blob out of a raw body before parsing the
rest (see :mod:`r3data.wire.splice`). Every claim an envelope makes (dtype, shape, byte count)
is checked against the blob's length before anything sized by the claim is allocated.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pybase64

from r3data.errors import WireFormatError
from r3data.wire.blob import Blob, decode_base64
from r3data.wire.dtypes import ROUTE_DTYPES, DTypeLike, compact_route_dtype, parse_dtype

__all__ = [
    "ENVELOPE_KEYS",
    "array_from_buffer",
    "check_nbytes",
    "compact_routes",
    "envelope_spec",
    "pack_ndarray",
    "unpack_ndarray",
]

#: Keys an envelope reserves; everything else is sidecar.
ENVELOPE_KEYS = ("data", "shape", "dtype")

_MAX_NDIM = 32  # numpy 1.x limit; nothing on the wire needs more
_MAX_NBYTES = int(np.iinfo(np.intp).max)  # numpy refuses larger shapes, even empty ones


def _host_array(array: object, what: str) -> np.ndarray:
    """``array`` as a numpy array on the host (torch tensors from any device are moved)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if array.dtype == torch.bfloat16:
            raise WireFormatError(f"{what}: bfloat16 has no numpy dtype; cast the tensor first")
        return array.detach().resolve_conj().resolve_neg().cpu().contiguous().numpy()
    if isinstance(array, np.ndarray):
        return array
    raise WireFormatError(
        f"{what}: expected a numpy array or torch tensor, found {type(array).__name__}"
    )


def pack_ndarray(
    array: Any, *, allowed_dtypes: Iterable[DTypeLike] | None = None, **sidecar: Any
) -> dict[str, Any]:
    """Encode ``array`` (numpy, or torch on any device) as an envelope with ``data`` first.

    ``sidecar`` entries are appended after the three reserved keys and may not reuse them.
    """
    clash = sorted(set(ENVELOPE_KEYS) & sidecar.keys())
    if clash:
        raise WireFormatError(f"pack_ndarray: sidecar keys {clash} collide with {ENVELOPE_KEYS}")
    host = _host_array(array, "pack_ndarray")
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    dtype = parse_dtype(host.dtype, allowed_dtypes)
    flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    return {
        "data": pybase64.b64encode_as_string(flat),
        "shape": [int(n) for n in host.shape],
        "dtype": dtype.name,
        **sidecar,
    }


def _parse_shape(shape: object, ndim: int | None, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple):
        raise WireFormatError(
            f"{what}.shape: expected a list of ints, found {type(shape).__name__}"
        )
    if len(shape) > _MAX_NDIM or (ndim is not None and len(shape) != ndim):
        wanted = f"{ndim}" if ndim is not None else f"at most {_MAX_NDIM}"
        raise WireFormatError(f"{what}.shape: expected {wanted} dimensions, found {len(shape)}")
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise WireFormatError(
                f"{what}.shape: expected non-negative ints, found {n!r} in {list(shape)!r:.80}"
            )
    return tuple(shape)


def envelope_spec(
    envelope: object,
    *,
    allowed_dtypes: Iterable[DTypeLike] | None = None,
    ndim: int | None = None,
    what: str = "envelope",
) -> tuple[np.dtype, tuple[int, ...], dict[str, Any]]:
    """Check an envelope's keys, dtype and shape; return ``(dtype, shape, sidecar)``."""
    if not isinstance(envelope, Mapping):
        raise WireFormatError(
            f"{what}: expected an object with {list(ENVELOPE_KEYS)}, "
            f"found {type(envelope).__name__}"
        )
    missing = [key for key in ENVELOPE_KEYS if key not in envelope]
    if missing:
        raise WireFormatError(f"{what}: missing {missing}, found keys {list(envelope)[:8]}")
    dtype = parse_dtype(envelope["dtype"], allowed_dtypes)
    shape = _parse_shape(envelope["shape"], ndim, what)
    sidecar = {key: value for key, value in envelope.items() if key not in ENVELOPE_KEYS}
    return dtype, shape, sidecar


def check_nbytes(found: int, dtype: np.dtype, shape: tuple[int, ...], *, what: str) -> int:
    """The bytes of ``shape`` of ``dtype``, which must be ``found``; the shape must be one
    numpy can hold even when a zero extent makes it empty."""
    if math.prod(filter(None, shape)) * dtype.itemsize > _MAX_NBYTES:
        raise WireFormatError(
            f"{what}: expected a shape of at most {_MAX_NBYTES} bytes (zero extents aside), "
            f"found {list(shape)!r:.120} of {dtype.name}"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if found != nbytes:
        raise WireFormatError(
            f"{what}: expected {nbytes} bytes for shape {list(shape)} of {dtype.name}, "
            f"found {found} decoded bytes"
        )
    return nbytes


def array_from_buffer(
    buffer: bytes | bytearray | memoryview,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    what: str = "data",
) -> np.ndarray:
    """View decoded bytes as an array of ``shape`` and ``dtype``; the sizes must agree."""
    check_nbytes(len(buffer), dtype, shape, what=what)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def unpack_ndarray(
    envelope: object,
    *,
    allowed_dtypes: Iterable[DTypeLike] | None = None,
    ndim: int | None = None,
    what: str = "envelope",
) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode an envelope into ``(array, sidecar)``.

    ``data`` may be a ``str``, ``bytes``, ``bytearray`` or ``memoryview`` of base64, or the
    array :func:`~r3data.wire.splice.load_packed_body` already decoded (checked against
    ``shape`` and ``dtype``, not copied). A decoded array is writable and owns its buffer;
    ``sidecar`` holds every key but the reserved three.
    """
    dtype, shape, sidecar = envelope_spec(
        envelope, allowed_dtypes=allowed_dtypes, ndim=ndim, what=what
    )
    data = envelope["data"]
    if isinstance(data, Blob):
        data = data.chars
    if isinstance(data, np.ndarray):
        if data.dtype != dtype or data.shape != shape:
            raise WireFormatError(
                f"{what}.data: expected an array of shape {list(shape)} and {dtype.name}, "
                f"found {list(data.shape)} and {data.dtype}"
            )
        return data, sidecar
    where = f"{what}.data (shape {list(shape)}, {dtype.name})"
    decoded = decode_base64(data, expected_nbytes=math.prod(shape) * dtype.itemsize, what=where)
    return array_from_buffer(decoded, dtype, shape, what=where), sidecar


def compact_routes(array: Any) -> np.ndarray:
    """Routes ``[rows, layers, topk]`` in the smallest dtype holding their largest expert id.

    uint8 up to 255, uint16 up to 65535, else int32; negative ids are rejected. Returns the
    input itself when it already has that dtype.
    """
    routes = _host_array(array, "compact_routes")
    if routes.ndim != 3:
        raise WireFormatError(
            f"compact_routes: expected [rows, layers, topk], found shape {routes.shape}"
        )
    if routes.dtype.kind not in "iu":
        raise WireFormatError(f"compact_routes: expected integer ids, found {routes.dtype}")
    if routes.size == 0:
        return routes.astype(ROUTE_DTYPES[0], copy=False)
    if routes.dtype.kind == "i" and (low := int(routes.min())) < 0:
        row, layer, slot = np.unravel_index(int(routes.argmin()), routes.shape)
        raise WireFormatError(
            f"compact_routes: expected expert ids >= 0, found {low} at row {row}, "
            f"layer {layer}, slot {slot}"
        )
    high = int(routes.max())
    dtype = compact_route_dtype(high)
    if dtype is not None:
        return routes.astype(dtype, copy=False)
    raise WireFormatError(
        f"compact_routes: expected expert ids <= {np.iinfo(np.int32).max}, found {high}"
    )
