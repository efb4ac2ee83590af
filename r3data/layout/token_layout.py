"""``TokenLayout``: where every token of a micro-batch sits on one rank of a Megatron grid.

A micro-batch of B samples with real lengths ``lengths`` reaches a rank as follows (the rules
megatron-core 0.16 applies, verified against its source; see ``docs/megatron.md``):

- **BSHD** (``packed=False``): every sample is padded to one length S (``seq_length``, or the
  longest sample rounded up to ``pad_multiple``), on the right or the left.
- **THD** (``packed=True``): each sample is padded on the right to a multiple of
  ``pad_multiple`` and the padded samples are concatenated (``cu_seqlens_padded``).
- **CP** (``cp_size > 1``): a sequence of padded length P is cut into ``2 * cp_size`` chunks of
  ``P / (2 * cp_size)``; rank r keeps chunks r and ``2 * cp_size - 1 - r``, in that order. BSHD
  cuts the common length S (``get_batch_on_this_cp_rank``), THD each sample on its own
  (Transformer Engine's ``thd_get_partitioned_indices``).
- **SP** (``sequence_parallel`` with ``tp_size > 1``): TP rank t keeps the t-th contiguous
  1/TP slice of the CP-local sequence dimension. Without SP every TP rank sees all of it.
- The router flattens hidden states ``[seq, batch, hidden]``, so local tokens are **seq-major**:
  token ``s * B + b`` is sample b at local sequence index s (THD has batch 1).

``pad_multiple`` defaults to ``tp_size * 2 * cp_size`` with CP, else ``tp_size``; an override
(e.g. for FP8 alignment) must stay a multiple of ``2 * cp_size`` (with CP) and of
``cp_size * tp_size`` (with SP), so every chunk and slice is whole: their least common
multiple, as megatron needs (``cp_size * tp_size`` itself when TP is even).

Positions below are sample-relative: position p of sample b is row ``offsets[b] + p`` of the
packed batch.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from r3data.errors import LayoutError
from r3data.layout.stages import ModelLayers
from r3data.layout.token_runs import PAD, TokenRuns, TokenSegments
from r3data.spans import Span, merge
from r3data.validate import checked_int

LayerAxis = Literal["all", "moe"]
Ranges = list[list[Span]]


#: BSHD micro-batches of at most this many (sample, piece) pairs are cut into segments in
#: plain Python, larger ones from their runs (numpy).
SMALL_GRID = 16
#: Padded tokens a micro-batch may hold: its ``cu_seqlens_padded`` are int32, as its rows'.
MAX_TOKENS = 2**31 - 1


_MAX_TOKENS = 2**31 - 1
"""The most padded tokens of a micro-batch (its ``cu_seqlens_padded`` are int32), and so the
largest size of a parallel dimension and the largest padding multiple."""


def _checked_rank(name: str, size: object, rank: object) -> tuple[int, int]:
    """``(size, rank)`` of one parallel dimension as plain ints (numpy integers accepted)."""
    size = checked_int(f"{name}_size", size, minimum=1, maximum=_MAX_TOKENS, error=LayoutError)
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < size:
        raise LayoutError(f"{name}_rank must be in [0, {size}), found {rank!r}")
    return size, int(rank)


def _too_many_tokens(found: int) -> LayoutError:
    return LayoutError(
        f"expected at most 2**31-1 padded tokens in a micro-batch (its cu_seqlens_padded are "
        f"int32), found {found}"
    )


def as_lengths(lengths: Any) -> np.ndarray:
    """Sample lengths as a host int64 array (B), validated."""
    if hasattr(lengths, "detach"):
        lengths = lengths.detach().cpu().numpy()
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise LayoutError(
            f"lengths must be a 1-D integer array, found dtype {array.dtype} and shape {array.shape}"
        )
    array = array.astype(np.int64)
    if array.size and array.min() < 0:
        raise LayoutError(
            f"lengths must be >= 0, found {int(array.min())} at {int(array.argmin())}"
        )
    return array


@dataclass(frozen=True)
class TokenLayout:
    """How one micro-batch sits on one (TP, CP, PP) rank. Geometry methods take the lengths."""

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vpp_size: int | None = None
    packed: bool = True
    padding_side: Literal["left", "right"] = "right"
    pad_multiple: int | None = None
    seq_length: int | None = None
    layers: ModelLayers | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp"):  # stored as ints: numpy ones would wrap (int8 * 2)
            size, rank = _checked_rank(
                name, getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            )
            object.__setattr__(self, f"{name}_size", size)
            object.__setattr__(self, f"{name}_rank", rank)
        for name in ("sequence_parallel", "packed"):  # "false" is truthy: never a flag
            flag = getattr(self, name)
            if not isinstance(flag, bool | np.bool_):
                raise LayoutError(f"{name} must be a bool, found {flag!r}")
            object.__setattr__(self, name, bool(flag))
        if self.vpp_size not in (None, 1):
            raise LayoutError(
                f"virtual pipeline parallelism is not supported, found vpp_size={self.vpp_size}: "
                "Megatron's RouterReplay pops one backward FIFO per router in forward order, "
                "which interleaved model chunks do not follow"
            )
        if self.padding_side not in ("left", "right"):
            raise LayoutError(
                f"padding_side must be 'left' or 'right', found {self.padding_side!r}"
            )
        if self.packed and self.padding_side != "right":
            raise LayoutError("packed (THD) layouts pad each sample on the right, found 'left'")
        if self.packed and self.seq_length is not None:
            raise LayoutError(f"seq_length is for BSHD layouts, found {self.seq_length} with THD")
        need = self.required_multiple
        widest = max(need, self.tp_size * self._cp_split)  # the default pad_multiple too
        if widest > _MAX_TOKENS:
            raise LayoutError(
                f"expected parallel sizes whose padding multiple is at most {_MAX_TOKENS}, found "
                f"{widest} (tp {self.tp_size}, cp {self.cp_size})"
            )
        if self.pad_multiple is not None and not _is_multiple(self.pad_multiple, need, 1):
            raise LayoutError(
                f"pad_multiple must be a positive multiple of {need} (2*CP with CP, and CP*TP "
                f"with SP) and at most 2**31-1, found {self.pad_multiple!r}"
            )
        if self.seq_length is not None and not _is_multiple(self.seq_length, need, 0):
            raise LayoutError(
                f"seq_length must be a non-negative multiple of {need} and at most 2**31-1, "
                f"found {self.seq_length!r}"
            )
        if self.layers is not None and not isinstance(self.layers, ModelLayers):
            raise LayoutError(f"layers must be a ModelLayers, found {type(self.layers).__name__}")

    def __str__(self) -> str:
        """The rank in a few words, for messages: ``tp 1/2 (SP), cp 0/2, THD``."""
        parts = [f"tp {self.tp_rank}/{self.tp_size}" + (" (SP)" if self.sequence_parallel else "")]
        parts += [
            f"{n} {r}/{s}"
            for n, r, s in (("cp", self.cp_rank, self.cp_size), ("pp", self.pp_rank, self.pp_size))
            if s > 1
        ]
        parts.append("THD" if self.packed else f"BSHD {self.padding_side}")
        return f"layout ({', '.join(parts)})"

    # --- derived sizes --------------------------------------------------------------------

    @property
    def sp_size(self) -> int:
        """How many ranks split the CP-local sequence (TP with sequence parallelism, else 1)."""
        return self.tp_size if self.sequence_parallel else 1

    @property
    def sp_rank(self) -> int:
        return self.tp_rank if self.sequence_parallel else 0

    @property
    def required_multiple(self) -> int:
        """The least multiple every padded length must be: of 2*CP (with CP: whole chunks) and
        of CP*TP (with SP: whole slices of each rank's CP-local sequence)."""
        return math.lcm(2 * self.cp_size if self.cp_size > 1 else 1, self.cp_size * self.sp_size)

    @property
    def per_sample(self) -> bool:
        """True when a sample's local rows depend on that sample alone: no split, THD without
        sequence parallelism (SP slices the batch's whole stream), or BSHD with a fixed
        ``seq_length`` (else the longest sample sets every padded length)."""
        if self.cp_size == 1 and self.sp_size == 1:
            return True
        return self.sp_size == 1 if self.packed else self.seq_length is not None

    @property
    def multiple(self) -> int:
        """The multiple samples are padded to (``pad_multiple`` or the default)."""
        if self.pad_multiple is not None:
            return self.pad_multiple
        return self.tp_size * self._cp_split

    # --- per-batch geometry ---------------------------------------------------------------

    def padded_lengths(self, lengths: Any) -> np.ndarray:
        """Length of every sample after padding (THD: own multiple; BSHD: the common S)."""
        lengths = as_lengths(lengths)
        if not self.packed:
            return np.full(lengths.size, self._common_length(lengths), dtype=np.int64)
        multiple = self.multiple
        if lengths.size and int(lengths.max()) > MAX_TOKENS:  # before rounding could wrap
            raise _too_many_tokens(sum(-(-n // multiple) * multiple for n in lengths.tolist()))
        padded = -(-lengths // multiple) * multiple
        if lengths.size and int(padded.sum()) > MAX_TOKENS:
            raise _too_many_tokens(int(padded.sum()))
        return padded

    def cu_seqlens(self, lengths: Any) -> np.ndarray:
        """Offsets of the real tokens, B+1 (host int64)."""
        return np.concatenate(([0], np.cumsum(as_lengths(lengths))))

    def cu_seqlens_padded(self, lengths: Any) -> np.ndarray:
        """Offsets of the padded samples, B+1 (host int64); THD attention takes both."""
        return np.concatenate(([0], np.cumsum(self.padded_lengths(lengths))))

    def num_local_tokens(self, lengths: Any) -> int:
        """Tokens this rank's routers see, padding included."""
        return int(self.padded_lengths(lengths).sum()) // (self.cp_size * self.sp_size)

    def token_runs(self, lengths: Any, *, local: bool = False) -> TokenRuns:
        """This rank's tokens as runs of consecutive packed-batch rows (or of padding).

        The runs tile the ``[local_seq, batch]`` grid of :meth:`token_grid` column by column;
        with ``local=True`` rows index a batch holding only each sample's
        :meth:`local_ranges` back to back (a rank-local read).
        """
        lengths = as_lengths(lengths)
        offsets = np.cumsum(lengths) - lengths
        if self.packed:
            sample, first, count = self._sp_clip(self._cp_runs(self.padded_lengths(lengths)))
            columns, column = 1, np.zeros_like(sample)
            place = np.cumsum(count) - count
            length, offset = lengths[sample], offsets[sample]
            local_seq = int(count.sum())
        else:  # [samples, pieces]: every sample keeps the same pieces of the common length
            common = self._common_length(lengths)
            start, count, place = _sequence_pieces(self, common)
            columns, column = lengths.size, np.arange(lengths.size)[:, None]
            length, offset = lengths[:, None], offsets[:, None]
            first = start - (common - length) if self.padding_side == "left" else start[None]
            local_seq = int(count.sum()) if columns else 0
        # Each run is leading padding (BSHD left padding), real rows, trailing padding.
        real_from = np.minimum(np.maximum(-first, 0), count)
        real_to = np.minimum(np.maximum(length - first, real_from), count)
        real = real_to - real_from
        pieces = np.empty((4, *real.shape, 3), dtype=np.int64)  # column, place, row, count
        column_of, place_of, row_of, count_of = pieces
        column_of[...] = column[..., None]
        place_of[..., 0], place_of[..., 1] = place, place + real_from
        place_of[..., 2] = place + real_to
        count_of[..., 0], count_of[..., 1], count_of[..., 2] = real_from, real, count - real_to
        row_of[..., ::2] = PAD
        if local:  # a sample's local rows come in position order
            row_of[..., 1] = (np.cumsum(real) - real.reshape(-1)).reshape(real.shape)
        else:
            row_of[..., 1] = offset + first + real_from
        return TokenRuns.from_pieces(local_seq, columns, pieces.reshape(4, -1))

    def token_segments(self, lengths: Any, *, local: bool = False) -> TokenSegments:
        """This rank's token grid cut into segments where every column's rows run on
        (:class:`TokenSegments`), as :meth:`TokenRuns.segments` of :meth:`token_runs` cuts it.

        BSHD micro-batches of a few samples are cut straight from the pieces of the common
        length every sample keeps, in plain Python (:func:`_pieces_segments`: no runs built,
        no numpy call per step); larger ones and THD from the runs.
        """
        lengths = as_lengths(lengths)
        if self.packed:
            return self.token_runs(lengths, local=local).segments()
        common = self._common_length(lengths)
        start, count, place = _sequence_pieces(self, common)  # [pieces]
        if lengths.size * start.size > SMALL_GRID:
            return self.token_runs(lengths, local=local).segments()
        if not lengths.size or not common:
            return TokenSegments(
                0, lengths.size, np.zeros(1, np.int64), np.empty((0, lengths.size), np.int64)
            )
        pieces = list(zip(start.tolist(), count.tolist(), place.tolist(), strict=True))
        left = self.padding_side == "left"
        bounds, first = _pieces_segments(pieces, lengths.tolist(), common, left, local)
        return TokenSegments(
            bounds[-1],
            lengths.size,
            np.array(bounds, np.int64),
            np.array(first, np.int64).reshape(-1, lengths.size),
        )

    def token_grid(self, lengths: Any, *, local: bool = False) -> np.ndarray:
        """``[local_seq, batch]``: the packed-batch row of every local token, or ``PAD``.

        Row s, column b is sample b at local sequence index s (THD: one column). Flattened
        row-major it is the router's token order. With ``local=True`` rows index a batch
        holding only each sample's :meth:`local_ranges` back to back (a rank-local read).
        """
        return self.token_runs(lengths, local=local).grid()

    def token_index(self, lengths: Any, *, local: bool = False) -> np.ndarray:
        """For every local token in router order: its packed-batch row, or ``PAD``."""
        return self.token_grid(lengths, local=local).reshape(-1)

    def local_ranges(self, lengths: Any) -> Ranges:
        """Per sample, the sorted disjoint ``(lo, hi)`` position ranges this rank's tokens cover."""
        lengths = as_lengths(lengths)
        sample, start, count = self._position_runs(lengths)
        real_lo = np.maximum(start, 0)
        real_hi = np.minimum(start + count, lengths[sample])
        keep = real_hi > real_lo
        ranges: Ranges = [[] for _ in range(lengths.size)]
        for b, lo, hi in zip(
            sample[keep].tolist(), real_lo[keep].tolist(), real_hi[keep].tolist(), strict=True
        ):
            ranges[b].append((lo, hi))
        return [merge(r) for r in ranges]

    def local_lengths(self, lengths: Any) -> np.ndarray:
        """Rows per sample a rank-local read holds (the sizes of :meth:`local_ranges`)."""
        return np.array(
            [sum(hi - lo for lo, hi in r) for r in self.local_ranges(lengths)], np.int64
        )

    def moe_layers(self, route_layers: int, layer_axis: LayerAxis) -> tuple[int, ...]:
        """Indices into a routes' layer axis of the MoE layers this pipeline stage builds.

        ``layer_axis="all"``: the axis has one entry per decoder layer (vLLM, SGLang: dense
        layers are zero rows). ``"moe"``: one entry per MoE layer, in layer order. Without
        ``layers`` every entry of the axis is taken to be an MoE layer.
        """
        if layer_axis not in ("all", "moe"):
            raise LayoutError(f"layer_axis must be 'all' or 'moe', found {layer_axis!r}")
        return _stage_moe_layers(self.layers, self.pp_size, self.pp_rank, route_layers, layer_axis)

    # --- internals ------------------------------------------------------------------------

    @property
    def _cp_split(self) -> int:
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def _common_length(self, lengths: np.ndarray) -> int:
        longest = int(lengths.max()) if lengths.size else 0
        if self.seq_length is None:
            common = -(-longest // self.multiple) * self.multiple
        elif longest > self.seq_length:
            raise LayoutError(f"samples must fit seq_length {self.seq_length}, found {longest}")
        else:
            common = self.seq_length
        if common * lengths.size > MAX_TOKENS:
            raise _too_many_tokens(common * lengths.size)
        return common

    def _cp_runs(self, padded: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequence, start, count) runs this CP rank keeps, in local order."""
        sequences = np.arange(padded.size, dtype=np.int64)
        if self.cp_size == 1:
            return sequences, np.zeros_like(padded), padded
        chunk = padded // self._cp_split
        first, second = self.cp_rank, self._cp_split - 1 - self.cp_rank
        sequence = np.repeat(sequences, 2)
        start = np.stack([first * chunk, second * chunk], axis=1).reshape(-1)
        return sequence, start, np.repeat(chunk, 2)

    def _sp_clip(
        self, runs: tuple[np.ndarray, np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keep the SP rank's contiguous slice of a stream of runs."""
        sequence, start, count = runs
        if self.sp_size == 1:
            return runs
        ends = np.cumsum(count)
        slice_len = int(ends[-1]) // self.sp_size if ends.size else 0
        lo, hi = self.sp_rank * slice_len, (self.sp_rank + 1) * slice_len
        begins = ends - count
        new_begin, new_end = np.maximum(begins, lo), np.minimum(ends, hi)
        keep = new_end > new_begin
        return sequence[keep], (start + new_begin - begins)[keep], (new_end - new_begin)[keep]

    def _position_runs(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample, first real-or-padded position, count) runs local to this rank."""
        padded = self.padded_lengths(lengths)
        if self.packed:
            return self._sp_clip(self._cp_runs(padded))
        start, count, _ = _sequence_pieces(self, int(padded[0]) if padded.size else 0)
        batch = lengths.size
        shift = padded - lengths if self.padding_side == "left" else np.zeros_like(lengths)
        sample = np.repeat(np.arange(batch, dtype=np.int64), start.size)
        return sample, np.tile(start, batch) - np.repeat(shift, start.size), np.tile(count, batch)


def _is_multiple(value: object, need: int, minimum: int) -> bool:
    """True when ``value`` is an int (not a bool) in ``[minimum, MAX_TOKENS]`` and a multiple
    of ``need``."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and minimum <= value <= MAX_TOKENS
        and not value % need
    )


@functools.lru_cache(maxsize=4096)
def _sequence_pieces(layout: TokenLayout, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, count, place)`` of the pieces of one sequence of padded ``length`` that
    ``layout``'s rank keeps, in local order (``place``: where each begins locally); read-only.

    Cached: every BSHD sample of a micro-batch has this length, and micro-batches repeat it
    (a fixed ``seq_length``, or the few multiples of ``pad_multiple`` the longest sample
    rounds up to).
    """
    _, start, count = layout._sp_clip(layout._cp_runs(np.array([length], dtype=np.int64)))
    place = np.cumsum(count) - count
    for array in (start, count, place):
        array.setflags(write=False)
    return start, count, place


def _pieces_segments(
    pieces: list[tuple[int, int, int]], lengths: list[int], common: int, left: bool, local: bool
) -> tuple[list[int], list[list[int]]]:
    """``(bounds, first)`` of the :class:`TokenSegments` of a BSHD grid whose samples (of
    ``lengths``, padded to ``common`` on the left or right) all keep ``pieces`` (``(start,
    count, place)`` of the common length, in local order), as lists.

    Cut at every piece and where any sample's real rows start or end, then joined where
    every column continues, as :meth:`TokenSegments.joined` does.
    """
    shifts = [common - n if left else 0 for n in lengths]
    reals = []  # per piece, per sample: its real places within the piece, [lo, hi)
    cuts = set()
    for start, count, place in pieces:
        real = []
        for n, shift in zip(lengths, shifts, strict=True):
            lo = min(max(shift - start, 0), count)
            hi = min(max(n + shift - start, lo), count)
            real.append((lo, hi))
            cuts.update((place + lo, place + hi))
        reals.append(real)
        cuts.add(place)
    if local:  # a sample's local rows come in position order, samples back to back
        held = [sum(real[b][1] - real[b][0] for real in reals) for b in range(len(lengths))]
        offsets = list(itertools.accumulate(held, initial=0))
    else:
        offsets = list(itertools.accumulate(lengths, initial=0))
    local_seq = pieces[-1][1] + pieces[-1][2]
    bounds: list[int] = []
    first: list[list[int]] = []
    piece, done = 0, [0] * len(lengths)  # per sample: local rows of the pieces before
    for cut in sorted(cuts):
        if cut >= local_seq:
            continue
        while piece + 1 < len(pieces) and pieces[piece + 1][2] <= cut:
            done = [d + hi - lo for d, (lo, hi) in zip(done, reals[piece], strict=True)]
            piece += 1
        start, _, place = pieces[piece]
        rows = []
        for b, (n, shift) in enumerate(zip(lengths, shifts, strict=True)):
            at = start - shift + cut - place  # the sample's position at this place
            if not 0 <= at < n:
                rows.append(PAD)
            elif local:
                rows.append(offsets[b] + done[b] + cut - place - reals[piece][b][0])
            else:
                rows.append(offsets[b] + at)
        if first:
            step = cut - bounds[-1]
            if all(
                r == (PAD if f == PAD else f + step) for r, f in zip(rows, first[-1], strict=True)
            ):
                continue
        bounds.append(cut)
        first.append(rows)
    bounds.append(local_seq)
    return bounds, first


@functools.lru_cache(maxsize=256)
def _stage_moe_layers(
    layers: ModelLayers | None, pp_size: int, pp_rank: int, route_layers: int, layer_axis: str
) -> tuple[int, ...]:
    """:meth:`TokenLayout.moe_layers` (cached: layouts and layer patterns are frozen)."""
    model = layers or ModelLayers(num_layers=max(route_layers, 1))
    moe_ids = model.moe_layer_ids
    expected = model.num_layers if layer_axis == "all" else len(moe_ids)
    if route_layers != expected:
        raise LayoutError(
            f"routes hold {route_layers} layers; layer_axis={layer_axis!r} of a model with "
            f"{model.num_layers} layers ({len(moe_ids)} MoE) expects {expected}"
        )
    local = model.moe_stage(pp_size, pp_rank)
    if layer_axis == "all":
        return local
    position = {layer: i for i, layer in enumerate(moe_ids)}
    return tuple(position[layer] for layer in local)
