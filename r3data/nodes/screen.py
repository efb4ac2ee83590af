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


def _below(ored: np.ndarray, dtype: np.dtype, limit: int) -> bool:
    """Whether every id is below ``limit``, from the bitwise OR of the rows' words: exact for
    unsigned ids and a power-of-two ``limit`` (no id has a bit at or above it)."""
    if dtype.kind != "u" or limit & (limit - 1):
        return False
    every = np.bitwise_or.reduce(ored)
    return int(np.bitwise_or.reduce(np.frombuffer(every.tobytes(), dtype))) < limit


def screen_rows(rows: np.ndarray, options: ScreenOptions) -> RowFlags:
    """Screen ``rows`` (``[n, *row_shape]``, C-contiguous): one pass over the bytes (the OR of
    each row's words) in the usual case, another only for what it cannot settle."""
    n = rows.shape[0]
    if n == 0 or rows.size == 0:
        return RowFlags(None, None, None)
    flat = rows.reshape(n, -1)
    ored = np.bitwise_or.reduce(_words(flat), axis=1)
    zero = None
    if options.zero_rows != "keep":
        zero = ored == 0
        if not zero.any():
            zero = None
    negative = None
    if flat.dtype.kind == "i" and int(flat.min()) < 0:
        negative = flat.min(axis=1) < 0
    too_large = None
    limit = options.num_experts
    if (
        limit is not None
        and limit - 1 < np.iinfo(flat.dtype).max
        and not _below(ored, flat.dtype, limit)
        and int(flat.max()) >= limit
    ):
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
