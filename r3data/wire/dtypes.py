"""The dtypes allowed on the wire and in payload files.

Arrays travel as raw little-endian bytes next to a numpy dtype name. Only plain numeric
dtypes are accepted: never object, string, void or structured dtypes (their bytes are not
self-contained or could smuggle pickles), and never a byte order other than little-endian.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

from r3data.errors import WireFormatError

__all__ = ["ALL_DTYPES", "ROUTE_DTYPES", "DTypeLike", "compact_route_dtype", "parse_dtype"]

#: Expert-id dtypes: the unsigned ladder ``compact_routes`` picks from (smallest first), int64
#: as sent by trainers that keep indices in torch's default integer type, then the signed
#: int8 and int16 of NeMo-RL and SkyRL (where -1 means "no route").
ROUTE_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name) for name in ("uint8", "uint16", "int32", "int64", "int8", "int16")
)

#: Names of every dtype any field may use (bfloat16 has no numpy dtype and is not listed).
ALL_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    }
)

DTypeLike = str | np.dtype | type

_MAX_SHOWN = 40  # characters of an unparseable dtype echoed in an error message


@lru_cache(maxsize=64)
def _names_of(allowed: tuple[DTypeLike, ...]) -> frozenset[str]:
    return frozenset(np.dtype(entry).name for entry in allowed)


def _is_little_endian(dtype: np.dtype) -> bool:
    if dtype.byteorder == "=":
        return sys.byteorder == "little"
    return dtype.byteorder in ("<", "|")


def _rejected(names: frozenset[str], found: str) -> WireFormatError:
    return WireFormatError(f"dtype: expected one of {sorted(names)} (little-endian), {found}")


@lru_cache(maxsize=512)
def _parse(name: DTypeLike, names: frozenset[str]) -> np.dtype:
    if isinstance(name, str) and name.lstrip("<>|=")[:1] == "a":  # numpy warns on its bytes alias
        raise _rejected(names, f"found unknown dtype {name!r:.{_MAX_SHOWN}}")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        raise _rejected(names, f"found unknown dtype {name!r:.{_MAX_SHOWN}}") from None
    if dtype.name not in names or dtype.fields is not None or dtype.subdtype is not None:
        raise _rejected(names, f"found {dtype.str!r} ({dtype.name})")
    if not _is_little_endian(dtype):
        raise _rejected(names, f"found big-endian {dtype.str!r}")
    return dtype


def parse_dtype(name: object, allowed: Iterable[DTypeLike] | None = None) -> np.dtype:
    """Resolve a wire dtype (a name such as ``"uint8"`` or ``"<u2"``, or a numpy dtype).

    ``allowed`` narrows the accepted set (names, numpy dtypes or scalar types); by default any
    of :data:`ALL_DTYPES`. Raises :class:`WireFormatError` naming what was found and what is
    allowed.
    """
    names = ALL_DTYPES if allowed is None else _names_of(tuple(allowed))
    if isinstance(name, str | np.dtype) or (
        isinstance(name, type) and issubclass(name, np.generic)
    ):
        return _parse(name, names)
    raise _rejected(names, f"found {type(name).__name__} {name!r:.{_MAX_SHOWN}}")


def compact_route_dtype(max_id: int) -> np.dtype | None:
    """The narrowest route dtype holding ids up to ``max_id``: uint8, uint16, else int32
    (None when not even int32 holds it)."""
    for dtype in ROUTE_DTYPES[:3]:
        if max_id <= np.iinfo(dtype).max:
            return dtype
    return None
