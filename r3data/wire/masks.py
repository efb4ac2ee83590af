"""Per-token side channels: ragged sampling masks (CSR) and float values such as logprobs.

A sampling mask gives, for each completion token, the set of token ids the sampler kept
(after top-k/top-p/min-p). On the wire it is CSR, ``{"ids": <int32 envelope>, "counts":
<int32 envelope>}`` with ``counts[i]`` the size of token i's set and ``ids`` every set back
to back. Token-aligned batches want one row per token, so the padded form is ``[tokens,
widest]`` int32 with each row's ids first and :data:`MASK_FILL` (-1) after them.

Per-token floats travel as float32 envelopes, where -inf is an ordinary IEEE value. JSON
number lists cannot hold -inf (``json`` writes the non-standard ``-Infinity``; orjson and
JavaScript write ``null``), so :func:`floats_to_json` writes :data:`NEG_INF_SENTINEL`, the
most negative float32, instead; :func:`floats_from_json` reads it, anything below it, and
``null`` back as -inf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3data.errors import ConfigError, PackedError, WireFormatError
from r3data.ragged import MASK_FILL, MAX_TOKEN_ID, RaggedRows, first_bad_id
from r3data.wire.envelope import pack_ndarray, unpack_ndarray

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "DEFAULT_MAX_PADDING",
    "MASK_FILL",
    "NEG_INF_SENTINEL",
    "SMALL_PADDED_ELEMENTS",
    "check_csr",
    "csr_to_padded",
    "floats_from_json",
    "floats_to_json",
    "pack_csr",
    "padded_to_csr",
    "unpack_csr",
]

#: Largest padded mask (cells) built unless the caller raises it: 1 GiB of int32.
DEFAULT_MAX_ELEMENTS = 1 << 28

#: Padded cells allowed per CSR element present (ids plus counts). Every mask whose widest set
#: holds at most this many ids passes; a few wide sets among many small ones need a larger
#: ratio (or None), so a small body cannot make :func:`csr_to_padded` allocate a huge array.
DEFAULT_MAX_PADDING = 1024

#: Padded masks up to this many cells (16 MiB of int32) pass whatever their padding.
SMALL_PADDED_ELEMENTS = 1 << 22

#: What -inf becomes in a JSON list of floats: the most negative float32 (exact in float64).
NEG_INF_SENTINEL = float(np.finfo(np.float32).min)

_INT32_MAX = int(np.iinfo(np.int32).max)


def _int_vector(values: Any, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise WireFormatError(
            f"{what}: expected a 1-D integer array, found shape {array.shape} of {array.dtype}"
        )
    return array


def check_csr(ids: Any, counts: Any, *, what: str = "mask") -> tuple[np.ndarray, np.ndarray]:
    """Validate a CSR mask; return ``(ids, counts)`` as int32 arrays."""
    ids = _int_vector(ids, f"{what}.ids")
    counts = _int_vector(counts, f"{what}.counts")
    if counts.size and int(counts.min()) < 0:
        raise WireFormatError(
            f"{what}.counts: expected sizes >= 0, found {int(counts.min())} at token "
            f"{int(counts.argmin())}"
        )
    if counts.size and int(counts.max()) > _INT32_MAX:  # before any cast could wrap it
        raise WireFormatError(
            f"{what}.counts: expected sizes <= {_INT32_MAX}, found {int(counts.max())} at token "
            f"{int(counts.argmax())}"
        )
    total = int(counts.sum(dtype=np.int64))
    if total != ids.size:
        raise WireFormatError(
            f"{what}: expected len(ids) == sum(counts) == {total}, found {ids.size} ids"
        )
    if first_bad_id(ids) is not None:
        raise WireFormatError(
            f"{what}.ids: expected token ids in [0, {MAX_TOKEN_ID}], found "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    return ids.astype(np.int32, copy=False), counts.astype(np.int32, copy=False)


def csr_to_padded(
    ids: Any,
    counts: Any,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    max_padding: float | None = DEFAULT_MAX_PADDING,
    what: str = "mask",
) -> np.ndarray:
    """CSR mask -> ``[tokens, widest]`` int32, each row's ids first, then :data:`MASK_FILL`.

    Raises :class:`WireFormatError` before allocating when ``tokens * widest`` exceeds
    ``max_elements``, or exceeds both :data:`SMALL_PADDED_ELEMENTS` and ``max_padding`` times
    the ids and counts present (None: no such bound).
    """
    if max_padding is not None and (
        isinstance(max_padding, bool)
        or not isinstance(max_padding, int | float)
        or max_padding <= 0
    ):
        raise ConfigError(f"max_padding: expected a number > 0 or None, found {max_padding!r}")
    ids, counts = check_csr(ids, counts, what=what)
    widest = int(counts.max()) if counts.size else 0
    cells = counts.size * widest
    if cells > max_elements:
        raise WireFormatError(
            f"{what}: padded form [{counts.size}, {widest}] exceeds {max_elements} elements"
        )
    present = ids.size + counts.size
    if max_padding is not None and cells > max(SMALL_PADDED_ELEMENTS, max_padding * present):
        raise WireFormatError(
            f"{what}: expected a padded form of at most {max_padding} x the {present} ids and "
            f"counts present, found [{counts.size}, {widest}] = {cells} cells; pass a larger "
            f"max_padding (or None) to allow it"
        )
    return RaggedRows.from_lengths(ids, counts, what=what).padded(max_cells=max_elements)


def padded_to_csr(padded: Any, *, what: str = "mask") -> tuple[np.ndarray, np.ndarray]:
    """``[tokens, widest]`` mask padded with :data:`MASK_FILL` -> CSR ``(ids, counts)`` int32."""
    try:
        rows = RaggedRows.from_padded(padded, fill=MASK_FILL, what=what)
    except PackedError as exc:
        raise WireFormatError(str(exc)) from None
    ids = rows.values
    if first_bad_id(ids) is not None:
        raise WireFormatError(
            f"{what}: expected token ids in [0, {MAX_TOKEN_ID}] or {MASK_FILL}, found "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    return ids.astype(np.int32, copy=False), rows.lengths.astype(np.int32)


def pack_csr(ids: Any, counts: Any, *, what: str = "mask") -> dict[str, dict[str, Any]]:
    """CSR mask -> ``{"ids": <int32 envelope>, "counts": <int32 envelope>}``."""
    ids, counts = check_csr(ids, counts, what=what)
    return {"ids": pack_ndarray(ids), "counts": pack_ndarray(counts)}


def unpack_csr(mask: object, *, what: str = "mask") -> tuple[np.ndarray, np.ndarray]:
    """``{"ids": <envelope>, "counts": <envelope>}`` (encoded or spliced) -> ``(ids, counts)``."""
    if not isinstance(mask, Mapping) or "ids" not in mask or "counts" not in mask:
        found = list(mask)[:8] if isinstance(mask, Mapping) else type(mask).__name__
        raise WireFormatError(f"{what}: expected an object with 'ids' and 'counts', found {found}")
    ids, _ = unpack_ndarray(mask["ids"], allowed_dtypes=("int32",), ndim=1, what=f"{what}.ids")
    counts, _ = unpack_ndarray(
        mask["counts"], allowed_dtypes=("int32",), ndim=1, what=f"{what}.counts"
    )
    return check_csr(ids, counts, what=what)


def floats_to_json(values: Any, *, what: str = "floats") -> list[float]:
    """1-D floats -> a JSON-safe list, -inf written as :data:`NEG_INF_SENTINEL`.

    NaN and +inf have no JSON form and raise :class:`WireFormatError`.
    """
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise WireFormatError(f"{what}: expected a 1-D array, found shape {array.shape}")
    bad = np.isnan(array) | np.isposinf(array)
    if bad.any():
        index = int(bad.argmax())
        raise WireFormatError(
            f"{what}: expected finite values or -inf, found {array[index]} at token {index}"
        )
    return np.where(np.isneginf(array), NEG_INF_SENTINEL, array).tolist()


def floats_from_json(
    values: Sequence[float | None], *, dtype: Any = np.float32, what: str = "floats"
) -> np.ndarray:
    """A JSON list of floats -> 1-D array; the sentinel, anything below it and null -> -inf."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise WireFormatError(f"{what}: expected a list of numbers or null ({err})") from None
    if array.ndim != 1:
        raise WireFormatError(f"{what}: expected a flat list, found shape {array.shape}")
    array[np.isnan(array) | (array <= NEG_INF_SENTINEL)] = -np.inf
    return array.astype(dtype)
