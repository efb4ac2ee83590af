"""``TokenRuns``: a rank's token grid as runs of consecutive packed-batch rows or of padding.

A rank's tokens are a few long runs (a sample's chunk, a sequence-parallel slice, padding);
copying run by run moves rows with slice copies and no per-token index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3data.packed import aranges

#: ``token_index`` entry (and run row) of a padding token.
PAD = -1


@dataclass(frozen=True)
class TokenRuns:
    """Run i covers places ``place[i] : place[i] + count[i]`` of column ``column[i]`` of the
    ``[local_seq, columns]`` token grid and holds packed-batch rows ``row[i] : row[i] +
    count[i]``, or padding where ``row[i] == PAD``. Runs are ordered by (column, place), tile
    the grid exactly, and none is empty."""

    local_seq: int
    columns: int
    column: np.ndarray
    place: np.ndarray
    row: np.ndarray
    count: np.ndarray

    @classmethod
    def from_pieces(cls, local_seq: int, columns: int, pieces: np.ndarray) -> TokenRuns:
        """Runs from ordered pieces, an int64 ``[4, n]`` array of their columns, places, rows
        and counts: empty ones dropped, each joined to the one before it when it continues it
        (same column, next places, next rows or padding after padding)."""
        pieces = pieces[:, pieces[3] > 0]
        count = pieces[3]
        before = pieces[:3, :-1].copy()  # where the piece before each would continue
        before[1:] += count[:-1]
        same = pieces[:3, 1:] == before  # column, place, row
        pad = pieces[2] == PAD
        joins = np.zeros(count.size, dtype=bool)
        joins[1:] = same[0] & same[1] & (pad[1:] == pad[:-1]) & (pad[1:] | same[2])
        starts = np.nonzero(~joins)[0]
        runs = pieces[:, starts]
        if starts.size:
            runs[3] = np.add.reduceat(count, starts)
        return cls(local_seq, columns, *runs)

    @property
    def padding(self) -> np.ndarray:
        """Which runs are padding."""
        return self.row == PAD

    def segments(self) -> TokenSegments:
        """The grid cut wherever a run of any column starts or ends."""
        # Every run starts at 0 or where another of its column ends; runs are not empty.
        bounds = np.concatenate(([0], np.unique(self.place + self.count)))
        starts = bounds[:-1, None]
        key = self.column * self.local_seq + self.place  # ascending: runs are ordered
        at = np.searchsorted(key, np.arange(self.columns) * self.local_seq + starts, "right") - 1
        row = self.row[at]
        first = np.where(row == PAD, PAD, row + starts - self.place[at])
        return TokenSegments(self.local_seq, self.columns, bounds, first)

    def grid(self) -> np.ndarray:
        """``[local_seq, columns]``: the packed-batch row of every place, or ``PAD``."""
        grid = np.full((self.local_seq, self.columns), PAD, dtype=np.int64)
        real = ~self.padding
        count = self.count[real]
        places = aranges(self.place[real], count) * self.columns + np.repeat(
            self.column[real], count
        )
        grid.reshape(-1)[places] = aranges(self.row[real], count)
        return grid


@dataclass(frozen=True)
class TokenSegments:
    """The ``[local_seq, columns]`` token grid cut into segments of places in which every
    column holds consecutive packed-batch rows or padding: within segment ``k`` (places
    ``bounds[k] : bounds[k + 1]``) column ``b`` holds rows ``first[k, b]`` onwards, one per
    place, or padding where ``first[k, b] == PAD``. Segments are maximal: each bound is where
    some column stops continuing. ``first`` is ``[segments, columns]``; ``bounds`` is ``[0]``
    for an empty grid."""

    local_seq: int
    columns: int
    bounds: np.ndarray
    first: np.ndarray

    @classmethod
    def joined(
        cls, local_seq: int, columns: int, bounds: np.ndarray, first: np.ndarray
    ) -> TokenSegments:
        """Segments from finer ones (ascending ``bounds`` from 0 to ``local_seq``), each
        joined to the one before it where every column continues it."""
        if first.shape[0] < 2:
            return cls(local_seq, columns, bounds, first)
        before = first[:-1]
        follows = before + (bounds[1:-1] - bounds[:-2])[:, None]
        follows[before == PAD] = PAD
        keep = np.empty(first.shape[0] + 1, dtype=bool)  # and the last bound
        keep[0] = keep[-1] = True
        np.logical_or.reduce(first[1:] != follows, axis=1, out=keep[1:-1])
        return cls(local_seq, columns, bounds.compress(keep), first.compress(keep[:-1], axis=0))

    def rows(self, begin: int = 0, end: int | None = None) -> np.ndarray:
        """``[places, columns]``: the packed-batch row (or ``PAD``) of every place of
        segments ``begin:end`` (by default all of them)."""
        end = self.first.shape[0] if end is None else end
        bounds = self.bounds[begin : end + 1]
        segment = np.repeat(np.arange(begin, end), np.diff(bounds))
        first = self.first[segment]
        offset = np.arange(bounds[0], bounds[-1]) - self.bounds[segment]
        return np.where(first == PAD, PAD, first + offset[:, None])

    def grid(self) -> np.ndarray:
        """``[local_seq, columns]``: the packed-batch row of every place, or ``PAD``."""
        return self.rows()
