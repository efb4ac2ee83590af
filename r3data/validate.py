"""The one integer check: counts, lengths, positions and options given as ints.

Bools are refused (``True`` is an int to Python, never a length to a user) and numpy integers
are accepted and returned as ``int``; the message names the value, what was expected and what
was found, in the error class the caller's family uses.
"""

from __future__ import annotations

import numpy as np

from r3data.errors import ConfigError, R3DataError

__all__ = ["checked_int", "nonnegative_int"]


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


def nonnegative_int(name: str, value: object, error: type[R3DataError] = ConfigError) -> int:
    """``value`` as an int >= 0 (a length or a position), else ``error`` naming ``name``."""
    return checked_int(name, value, error=error)
