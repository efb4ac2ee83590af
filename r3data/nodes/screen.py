"""The one screen: what a route row may hold, checked once per row as the fill writes it.

Every route row, inline or read from a file, passes here exactly once, while its bytes are
still in cache. One vocabulary:

- a row zero in every entry is an engine bug (a known one returns correctly shaped all-zero
  routes): ``zero_rows="missing"`` (default) treats it as a row the engine did not produce, a
  gap the loader's ``on_gap`` policy handles; ``"raise"`` refuses it; ``"keep"`` keeps it;
- a row holding a negative id has no route there (NeMo-RL sends -1 for "no route"; SGLang's
  int32 ids can be anything): it is missing too, never an expert id;
- an id at or above ``num_experts`` (when given) is refused: no model has that expert;
- dense layers hold zeros in every row, which is what engines send for them; they make no
  row all-zero unless its MoE layers are zero too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from r3data.errors import ConfigError
from r3data.options import options
from r3data.validate import checked_int

__all__ = ["ZERO_ROWS", "RowFlags", "ScreenOptions", "ZeroRows", "dense_layers", "screen_rows"]

ZeroRows = Literal["missing", "raise", "keep"]
ZERO_ROWS = ("missing", "raise", "keep")


@options
class ScreenOptions:
    """How route rows are screened (see the module docstring); a misspelt option is a
    ``ConfigError``."""

    num_experts: int | None = None
    zero_rows: ZeroRows = "missing"

    def __post_init__(self) -> None:
        if self.zero_rows not in ZERO_ROWS:
            raise ConfigError(
                f"zero_rows: expected 'missing', 'raise' or 'keep', found {self.zero_rows!r}"
            )
        if self.num_experts is not None:
            checked_int("num_experts", self.num_experts, minimum=1)


@dataclass(frozen=True, slots=True)
class RowFlags:
    """What the screen found in a block of rows: per row, all-zero and holding a negative id,
    and the first id out of range as ``(row, flat entry, id)``."""

    zero: np.ndarray | None
    negative: np.ndarray | None
    too_large: tuple[int, int, int] | None


def _words(flat: np.ndarray) -> np.ndarray:
    """The rows as the widest unsigned words their bytes divide into (fewer, faster ops)."""
    raw = flat.view(np.uint8)
    for dtype in (np.uint64, np.uint32, np.uint16):
        if raw.shape[1] % np.dtype(dtype).itemsize == 0:
            return raw.view(dtype)
    return raw


def _zero_rows(flat: np.ndarray) -> np.ndarray | None:
    """Which rows are zero in every entry (None: none is).

    A real route row is never zero in a word that holds one layer's ``topk`` distinct ids, so
    one word column that is non-zero in the first row settles almost every row with one
    comparison; only the rows zero in that column are looked at whole.
    """
    words = _words(flat)
    probe = np.flatnonzero(words[0])
    if probe.size == 0:  # the first row is zero: every row looked at whole
        return np.bitwise_or.reduce(words, axis=1) == 0
    candidates = np.flatnonzero(words[:, int(probe[0])] == 0)
    if candidates.size == 0:
        return None
    whole = ~words[candidates].any(axis=1)
    if not whole.any():
        return None
    zero = np.zeros(flat.shape[0], bool)
    zero[candidates[whole]] = True
    return zero


def screen_rows(rows: np.ndarray, options: ScreenOptions) -> RowFlags:
    """Screen ``rows`` (``[n, *row_shape]``, C-contiguous): the extremes of every id and one
    word column of each row in the usual case; whole rows only where those cannot settle it."""
    n = rows.shape[0]
    if n == 0 or rows.size == 0:
        return RowFlags(None, None, None)
    flat = rows.reshape(n, -1)
    zero = None if options.zero_rows == "keep" else _zero_rows(flat)
    negative = None
    if flat.dtype.kind == "i" and int(flat.min()) < 0:
        negative = flat.min(axis=1) < 0
    too_large = None
    limit = options.num_experts
    if limit is not None and limit - 1 < np.iinfo(flat.dtype).max and int(flat.max()) >= limit:
        row, entry = np.unravel_index(int(np.argmax(flat >= limit)), flat.shape)
        too_large = (int(row), int(entry), int(flat[row, entry]))
    return RowFlags(zero, negative, too_large)


def dense_layers(routes: np.ndarray) -> tuple[int, ...]:
    """Layers whose every entry is 0, as engines report dense (non-MoE) layers.

    A real MoE row holds ``topk`` distinct experts, so with ``topk >= 2`` it is never all
    zero; with top-1 routing a MoE layer whose every token picked expert 0 looks dense too.
    """
    if routes.shape[0] == 0:
        return ()
    candidates = np.flatnonzero(~routes[0].any(axis=-1))
    return tuple(int(layer) for layer in candidates if not routes[:, layer].any())
