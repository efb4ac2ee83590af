"""The one integer check: counts, lengths, positions and options given as ints.

Bools are refused (``True`` is an int to Python, never a length to a user) and numpy integers
are accepted and returned as ``int``; the message names the value, what was expected and what
was found, in the error class the caller's family uses. :func:`checked_fill` does the same for
a fill value, which must be one the array's dtype holds exactly.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from r3data.errors import ConfigError, R3DataError, TraceError

INT64_MAX = int(np.iinfo(np.int64).max)
"""The largest count, length or offset r3data keeps (host offsets are int64)."""

__all__ = [
    "INT64_MAX",
    "checked_fill",
    "checked_int",
    "nonnegative_int",
    "request_length",
    "slice_bounds",
]


def checked_int(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    error: type[R3DataError] = ConfigError,
) -> int:
    """``value`` as an int in ``[minimum, maximum]``, else ``error`` naming ``name``."""
    if type(value) is int and value >= minimum and (maximum is None or value <= maximum):
        return value  # the usual case, checked without the slower instance tests
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(f"{name}: expected an int {bound}, found {value!r:.40}")
    return int(value)


def slice_bounds(
    index: slice, length: int, *, error: type[R3DataError] = ConfigError
) -> tuple[int, int, int]:
    """``index.indices(length)``; a zero step (Python's bare ValueError) is ``error``."""
    if index.step is not None and index.step == 0:
        raise error(f"slice step must not be zero, found {index!r:.60}")
    return index.indices(length)


def nonnegative_int(name: str, value: object, error: type[R3DataError] = ConfigError) -> int:
    """``value`` as an int >= 0 (a length or a position), else ``error`` naming ``name``."""
    return checked_int(name, value, error=error)


def request_length(name: str, value: object) -> int:
    """A request's token count: an int in ``[0, INT64_MAX]``, else a :class:`TraceError`
    naming ``name`` (the one rule of the trace builder and of ``Lengths``)."""
    return checked_int(name, value, maximum=INT64_MAX, error=TraceError)


def checked_fill(
    name: str,
    value: object,
    dtype: np.dtype | torch.dtype,
    *,
    error: type[R3DataError] = ConfigError,
) -> object:
    """``value`` if ``dtype`` (numpy or torch) holds it exactly, else ``error`` naming ``name``:
    ``-1`` is no ``uint8`` (it would be 255, a valid expert id), ``0.5`` no integer, ``1e10``
    no ``float16`` (past its largest finite value: torch refuses it, numpy makes it inf)."""
    if isinstance(dtype, torch.dtype):
        floating = dtype.is_floating_point or dtype.is_complex
        bounds = (0, 1) if dtype == torch.bool else None if floating else torch.iinfo(dtype)
        largest = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    else:
        kind = np.dtype(dtype).kind
        floating = kind in "fc"
        bounds = (0, 1) if kind == "b" else None if floating else np.iinfo(dtype)
        largest = float(np.finfo(dtype).max) if kind == "f" else math.inf
    if isinstance(value, numbers.Real | np.bool_):
        if floating:
            held = _within(value, largest)
        else:
            low, high = bounds if isinstance(bounds, tuple) else (bounds.min, bounds.max)
            try:
                held = int(value) == value and low <= value <= high
            except (OverflowError, ValueError):  # inf, nan
                held = False
        if held:
            return value
    raise error(f"{name}: expected a value {dtype} holds exactly, found {value!r:.40}")


def _within(value: numbers.Real | np.bool_, largest: float) -> bool:
    """Whether a float type whose largest finite value is ``largest`` holds ``value`` (inf
    and nan included)."""
    try:
        return not math.isfinite(value) or abs(value) <= largest
    except OverflowError:  # an int too large for any float
        return False
