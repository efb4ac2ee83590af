"""Expand packed routes into the per-layer, rank-local tensors a trainer's routers replay.

``expand`` gives Megatron's form: one ``[local_tokens, topk]`` tensor per MoE layer of this
pipeline stage, tokens in router order (see :class:`~r3data.layout.TokenLayout`).
``expand_batch_major`` gives ``[B, local_seq, topk]`` per layer for batch-major routers (FSDP,
torchtitan-style MoE).

Every row is read once from the packed values into one token-major output buffer
``[tokens, layers, topk]`` on the routes' device; the per-layer tensors are views of it (row
stride ``layers * topk``; ``torch.gather``/``scatter`` take them as they are). On the CPU the
rank's tokens come as runs (:meth:`~r3data.layout.TokenLayout.token_runs`): each long run is
one slice copy or padding fill, short runs are gathered together, and a seq-major grid of
several samples (whose rows interleave) is cut into segments where every sample's rows run on
and written a cache-sized block of places at a time, front to back, each sample's rows one
widening slice copy; on accelerators a gather of a bounded chunk of rows at a time. There is
no padded full-batch rectangle and no full-size intermediate. Padding tokens get ``fill``, by
default ``arange(topk)``: the all-to-all dispatcher assumes exactly ``tokens * topk`` distinct
assignments, so a padding row must never repeat an expert. ``RoundRobin(num_experts)``
instead gives each padding token its own run of ``topk`` experts by its place in the padded
batch, so padding spreads over all experts, and over expert-parallel ranks, whichever
rank holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from r3data.errors import LayoutError
from r3data.layout.rows import RankRows
from r3data.layout.stages import ModelLayers
from r3data.layout.token_layout import LayerAxis, TokenLayout, as_lengths
from r3data.layout.token_runs import PAD, TokenRuns, TokenSegments
from r3data.packed import PackedTensor, aranges
from r3data.tensor_buffer import bit_view
from r3data.validate import checked_int


@dataclass(frozen=True)
class RoundRobin:
    """Padding fill: the padding token at place ``p`` of the padded batch (every sample
    padded, before CP and SP split it) gets experts ``(p * topk + arange(topk)) %
    num_experts``: distinct in each row, spread round-robin over all experts."""

    num_experts: int

    def __post_init__(self) -> None:
        checked_int("RoundRobin.num_experts", self.num_experts, minimum=1, error=LayoutError)


Fill = Literal["distinct"] | RoundRobin | Sequence[int] | torch.Tensor

#: On accelerators, rows gathered at once stay under this many bytes (and 1/8 of the output).
CHUNK_BYTES = 64 << 20
#: On the CPU, a piece of the output reads at most this many source bytes (cache-sized).
PIECE_BYTES = 128 << 10
#: On the CPU, runs of consecutive rows (or of padding) this long are slice copies.
MIN_RUN_TOKENS = 32
#: On the CPU, short segments are gathered together when copying them one by one would take
#: more numpy calls than this (about what a gather of a few rows costs).
GATHER_CALLS = 12

_ROUTE_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64)
#: What ``torch.gather`` and Megatron's ``RouterReplay`` take as indices.
_OUTPUT_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


def expand(
    routes: PackedTensor,
    layout: TokenLayout | None = None,
    *,
    fill: Fill = "distinct",
    dtype: torch.dtype = torch.int32,
    layer_axis: LayerAxis = "all",
    local: bool | None = None,
    lengths: Any = None,
) -> list[torch.Tensor]:
    """One ``[local_tokens, topk]`` tensor per MoE layer this rank's stage builds, in order.

    The tensors are views of one token-major buffer on the routes' device; expand on the
    trainer's GPU so that Megatron's per-layer ``.to(scores.device)`` moves nothing.

    ``routes`` rows are ``[layers, topk]``; ``layer_axis`` says whether ``layers`` counts every
    decoder layer (``"all"``, as vLLM and SGLang report) or only MoE layers (``"moe"``).
    ``dtype`` is ``torch.int32`` or ``torch.int64``; int64 routes are checked to fit int32.

    Routes of a rank-local read (``r3data.loader(..., layout=...)``) are
    :class:`~r3data.layout.RankRows`: they carry their layout (``layout`` may be left out)
    and the full sample lengths, and expanding them with another layout, or as full rows
    (``local=False``, other ``lengths``), raises :class:`~r3data.errors.LayoutError`. Plain
    packed rows are full samples unless ``local=True, lengths=<full sample lengths>`` say they
    hold the rows of ``layout.local_ranges(lengths)`` of each sample, back to back.

    Dense layers: without the model's layer pattern (``TokenLayout(layers=ModelLayers(...))``,
    stated once; a rank-local batch carries its layout's), every entry of an ``"all"`` layer
    axis is taken for an MoE layer, and top-k >= 2 routes whose layer is zero in every row
    (what engines send for a dense layer) raise instead of being replayed as expert 0.
    """
    topk = _check_routes(routes)
    dtype = _output_dtype(dtype)
    fill_row = _fill_row(fill, topk, dtype)
    layout, full, local = _geometry(routes, layout, local, lengths)
    tokens = _walk(layout, full, local, routes.values.device)
    layers = _moe_layers(routes, layout, layer_axis)
    _check_ids_fit(routes.values, dtype)
    buffer = _gather(routes.values, tokens, layers, fill_row, dtype, batch_major=False)
    if isinstance(fill, RoundRobin):
        places = layout.token_grid(layout.padded_lengths(full))
        _spread_padding(buffer, tokens.grid(), places, fill)
    return list(buffer.view(tokens.local_seq * tokens.columns, len(layers), topk).unbind(1))


def expand_batch_major(
    routes: PackedTensor,
    layout: TokenLayout | None = None,
    *,
    fill: Fill = "distinct",
    dtype: torch.dtype = torch.int32,
    layer_axis: LayerAxis = "all",
    local: bool | None = None,
    lengths: Any = None,
) -> list[torch.Tensor]:
    """One ``[B, local_seq, topk]`` tensor per local MoE layer, batch-major (BSHD layouts),
    for routers that flatten ``[B, S, hidden]`` (FSDP, torchtitan-style MoE).

    The default layout is a single rank with right padding to the longest sample (rank-local
    routes: their own). Arguments are those of :func:`expand`, the rules for rank-local routes
    and dense layers included.
    """
    topk = _check_routes(routes)
    if layout is None and not isinstance(routes, RankRows):
        layout = TokenLayout(packed=False)
    elif layout is None and routes.is_whole and routes.layout.packed:
        layout = TokenLayout(packed=False)  # whole samples read for THD: one BSHD rank
    layout, full, local = _geometry(routes, layout, local, lengths)
    if layout.packed:
        raise LayoutError("expand_batch_major needs a BSHD layout (packed=False), found THD")
    dtype = _output_dtype(dtype)
    fill_row = _fill_row(fill, topk, dtype)
    runs = layout.token_runs(full, local=local)
    layers = _moe_layers(routes, layout, layer_axis)
    _check_ids_fit(routes.values, dtype)
    buffer = _gather(routes.values, runs, layers, fill_row, dtype, batch_major=True)
    if isinstance(fill, RoundRobin):
        places = layout.token_grid(layout.padded_lengths(full))
        _spread_padding(buffer, runs.grid().T, places.T, fill)
    return list(buffer.unbind(2))


def expand_mask(
    mask: PackedTensor,
    layout: TokenLayout | None = None,
    *,
    local: bool | None = None,
    lengths: Any = None,
) -> torch.Tensor:
    """A per-token mask (``[rows]`` or ``[rows, 1]``, bool or integer 0/1) in router order;
    padding is False. Rank-local masks (``RankRows``) follow the rules of :func:`expand`."""
    if not isinstance(mask, PackedTensor):
        raise LayoutError(f"mask must be a PackedTensor, found {type(mask).__name__}")
    if mask.row_shape not in ((), (1,)):
        raise LayoutError(f"mask rows must be scalars, found row shape {mask.row_shape}")
    layout, full, local = _geometry(mask, layout, local, lengths)
    index = layout.token_index(full, local=local)
    flat = _mask_bools(mask.values.reshape(-1))
    real = index != PAD
    if not real.any():
        return torch.zeros(index.size, dtype=torch.bool, device=flat.device)
    rows = torch.from_numpy(np.where(real, index, 0)).to(flat.device)
    return flat.index_select(0, rows) & torch.from_numpy(real).to(flat.device)


def _mask_bools(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as bools: a mask holds bools or integers 0 and 1; anything else (a float 0.5,
    an id 2, a -1) is not a mask, and ``.bool()`` would silently read it as True."""
    if flat.dtype == torch.bool:
        return flat
    expected = "mask: expected bool or integer 0/1 values"
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        raise LayoutError(f"{expected}, found dtype {flat.dtype}")
    other = (flat != 0) & (flat != 1)
    if other.any():
        at = int(other.nonzero()[0])
        raise LayoutError(f"{expected}, found {int(flat[at])} at row {at}")
    return flat.bool()


# --- where the rows are ----------------------------------------------------------------------


def _geometry(
    field: PackedTensor, layout: TokenLayout | None, local: bool | None, lengths: Any
) -> tuple[TokenLayout, np.ndarray, bool]:
    """``(layout, full sample lengths, rows are rank-local)`` for expanding ``field``.

    A :class:`RankRows` says itself how its rows were cut; anything the caller passes must
    agree with it. Rows cut by a layout that splits nothing are whole samples: any layout may
    expand them, and the read layout's layer pattern comes with them.
    """
    if not isinstance(field, RankRows):
        if layout is None:
            raise LayoutError(
                "expand needs the rank's TokenLayout for full rows (only a rank-local batch "
                "carries its own)"
            )
        local = bool(local)
        return layout, _full_lengths(field, layout, local, lengths), local
    read = field.layout
    if lengths is not None and not np.array_equal(as_lengths(lengths), field.full_lengths):
        raise LayoutError(
            f"lengths {as_lengths(lengths).tolist()[:8]} are not the full lengths these "
            f"rank-local rows were read for, {field.full_lengths.tolist()[:8]}"
        )
    if field.selected:
        raise LayoutError(
            f"these rank-local rows were selected from the micro-batch they were read for (a "
            f"slice, a gather or a cat): under {read} a sample's rows depend on the whole "
            "micro-batch, so they cannot be laid out alone; expand each micro-batch as read "
            "(loader(..., micro_batches=...) cuts the step)"
        )
    if field.is_whole:
        if local:
            raise LayoutError(
                f"local=True, but these rows are whole samples (read for {read}, which splits "
                "no sequence): expand them as full rows"
            )
        layout = _with_layers(read if layout is None else layout, read.layers)
        return layout, _full_lengths(field, layout, False, field.full_lengths), False
    if layout is not None and layout != read:
        raise LayoutError(
            f"these routes hold the rows of {read}; expanding them for another layout, {layout}, "
            "would put every token on the wrong rank: read the batch with that layout"
        )
    if local is False:
        raise LayoutError(
            f"local=False, but these routes hold only the rows of {read} (a rank-local read): "
            "they cannot be expanded as full samples"
        )
    return read, _full_lengths(field, read, True, field.full_lengths), True


def _with_layers(layout: TokenLayout, carried: ModelLayers | None) -> TokenLayout:
    if carried is None or layout.layers == carried:
        return layout
    if layout.layers is not None:
        raise LayoutError(
            f"the routes were read for layers {carried}, the layout states {layout.layers}"
        )
    return dataclasses.replace(layout, layers=carried)


def _moe_layers(
    routes: PackedTensor, layout: TokenLayout, layer_axis: LayerAxis
) -> tuple[int, ...]:
    """The layer-axis entries to expand; without a layer pattern, refuse layers that are zero
    in every row (dense layers, which engines report as zeros) instead of replaying them."""
    layers = layout.moe_layers(routes.row_shape[0], layer_axis)
    if layout.layers is None and layer_axis == "all":
        zero = _zero_layers(routes.values)
        if zero:
            raise LayoutError(
                f"layers {list(zero)} of the routes are zero in every row: dense layers, which "
                f"have no router; state the model's layer pattern once, "
                f"TokenLayout(layers=ModelLayers(num_layers={routes.row_shape[0]}, "
                "moe_layer_freq=...)), or pass routes of MoE layers only with layer_axis='moe'"
            )
    return layers


def _zero_layers(values: torch.Tensor) -> tuple[int, ...]:
    """Layers whose entries are zero in every row (candidates from the first row: one pass).

    A top-k >= 2 MoE row names k distinct experts, so it is never all zero; with top-1 a
    layer whose tokens all picked expert 0 cannot be told from a dense one: none is refused.
    """
    rows, _, topk = values.shape
    if not rows or topk < 2:
        return ()
    row = values.numpy()[0] if values.device.type == "cpu" else bit_view(values[0]).cpu().numpy()
    if bytes(topk * row.itemsize) not in row.tobytes():  # no layer's bytes can all be zero
        return ()
    first_row = np.flatnonzero(~row.any(axis=-1))  # one row to the host
    if not first_row.size:
        return ()
    bits = bit_view(values)
    candidates = torch.from_numpy(first_row).to(values.device)
    zero = ~bits.index_select(1, candidates).bool().any(dim=2).any(dim=0)
    return tuple(candidates[zero].tolist())


# --- checks --------------------------------------------------------------------------------


def _check_routes(routes: PackedTensor) -> int:
    if not isinstance(routes, PackedTensor):
        raise LayoutError(f"routes must be a PackedTensor, found {type(routes).__name__}")
    if len(routes.row_shape) != 2 or 0 in routes.row_shape:
        raise LayoutError(f"route rows must be [layers, topk], found row shape {routes.row_shape}")
    if routes.dtype not in _ROUTE_DTYPES:
        raise LayoutError(f"routes must hold integer expert ids, found dtype {routes.dtype}")
    return routes.row_shape[1]


def _full_lengths(
    field: PackedTensor, layout: TokenLayout, local: bool, lengths: Any
) -> np.ndarray:
    """The full sample lengths, checked against the rows ``field`` holds.

    The two ways to mix up full and rank-local rows get messages of their own.
    """
    if lengths is None:
        if local:
            raise LayoutError("local=True needs lengths: the full length of every sample")
        return field.lengths
    full = as_lengths(lengths)
    found = field.lengths
    if found.size != full.size:
        raise LayoutError(f"lengths name {full.size} samples, the batch holds {found.size}")
    expected = layout.local_lengths(full) if local else full
    wrong = np.flatnonzero(found != expected)
    if not wrong.size:
        return full
    at = int(wrong[0])
    if not local and np.array_equal(found, layout.local_lengths(full)):
        raise LayoutError(
            f"the batch holds this rank's local rows (sample {at}: {int(found[at])} of "
            f"{int(full[at])}); expand rank-local routes with local=True, lengths=<full lengths>"
        )
    if local and np.array_equal(found, full):
        raise LayoutError(
            f"local=True, but the batch holds lengths' own rows (sample {at}: {int(found[at])}, "
            f"this rank's share is {int(expected[at])}): lengths must be the full sample lengths "
            "(e.g. batch['token_ids'].lengths), or drop local=True for full routes"
        )
    what = "local rows" if local else "rows"
    raise LayoutError(f"sample {at} must hold {int(expected[at])} {what}, found {int(found[at])}")


def _output_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _OUTPUT_DTYPES:
        raise LayoutError(
            f"dtype must be torch.int32 or torch.int64 (indices for torch.gather and Megatron's "
            f"RouterReplay), found {dtype!r}"
        )
    return dtype


def _fill_row(fill: Fill, topk: int, dtype: torch.dtype) -> np.ndarray:
    """The padding row, checked: ``topk`` distinct ids >= 0 that fit ``dtype`` (int64, host)."""
    if isinstance(fill, RoundRobin):
        if topk > fill.num_experts:
            raise LayoutError(
                f"RoundRobin needs top-{topk} distinct experts of {fill.num_experts}, "
                f"found more picks than experts"
            )
        if fill.num_experts - 1 > torch.iinfo(dtype).max:
            raise LayoutError(f"fill ids must fit {dtype}, found {fill.num_experts - 1}")
        return np.arange(topk, dtype=np.int64)
    if isinstance(fill, str):
        if fill != "distinct":
            raise LayoutError(
                f"fill must be 'distinct' or {topk} distinct expert ids, found {fill!r}"
            )
        return np.arange(topk, dtype=np.int64)
    try:
        row = torch.as_tensor(fill)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise LayoutError(f"fill must hold {topk} integer expert ids, found {fill!r}") from error
    if row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool:
        raise LayoutError(f"fill must hold {topk} integer expert ids, found {fill!r}")
    if row.shape != (topk,):
        raise LayoutError(f"fill must hold {topk} integer expert ids, found {fill!r}")
    row = row.to(torch.int64)
    if int(row.min()) < 0 or row.unique().numel() != topk:
        raise LayoutError(f"fill must hold {topk} distinct expert ids >= 0, found {row.tolist()}")
    if int(row.max()) > torch.iinfo(dtype).max:
        raise LayoutError(f"fill ids must fit {dtype}, found {int(row.max())}")
    return row.cpu().numpy()


def _check_ids_fit(values: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse expert ids ``dtype`` cannot hold (int64 routes into int32; one pass, one sync)."""
    have, want = torch.iinfo(values.dtype), torch.iinfo(dtype)
    if (have.min >= want.min and have.max <= want.max) or not values.numel():
        return
    low, high = torch.aminmax(values)
    bad = int(low) if int(low) < want.min else int(high)
    if want.min <= bad <= want.max:
        return
    row = int(torch.nonzero(values == bad)[0, 0])
    raise LayoutError(
        f"routes hold expert id {bad} at row {row}, outside {dtype}: pass dtype=torch.int64"
    )


# --- the gather ----------------------------------------------------------------------------


def _walk(
    layout: TokenLayout, full: np.ndarray, local: bool, device: torch.device
) -> TokenRuns | TokenSegments:
    """How :func:`expand` walks the rank's grid: by segments for a seq-major grid of several
    samples on the CPU (their rows interleave place by place), else by runs."""
    if device.type == "cpu" and not layout.packed and full.size > 1:
        return layout.token_segments(full, local=local)
    return layout.token_runs(full, local=local)


def _gather(
    values: torch.Tensor,
    tokens: TokenRuns | TokenSegments,
    layers: tuple[int, ...],
    fill_row: np.ndarray,
    dtype: torch.dtype,
    *,
    batch_major: bool,
) -> torch.Tensor:
    """A token-major buffer whose place ``[s, b]`` holds ``values[row, layers]`` for the row
    ``tokens`` puts there (``fill_row`` at padding).

    The buffer is ``[S, B, L, K]``, or ``[B, S, L, K]`` when ``batch_major`` (then ``tokens``
    are runs: segments are for a seq-major buffer).
    """
    seq, batch = tokens.local_seq, tokens.columns
    shape = (len(layers), values.shape[2])
    buffer = _empty(
        (batch, seq, *shape) if batch_major else (seq, batch, *shape), dtype, values.device
    )
    if not buffer.numel():
        return buffer
    if values.device.type == "cpu":
        places = buffer.numpy().swapaxes(0, 1) if batch_major else buffer.numpy()
        fill_block = np.empty(shape, dtype=places.dtype)
        fill_block[...] = fill_row
        _copy_on_host(places, tokens, values.numpy(), layers, fill_block)
    else:
        grid = tokens.grid()
        index = (grid.T if batch_major else grid).reshape(-1)
        fill = torch.from_numpy(fill_row).to(buffer.device, dtype).expand(shape)
        _copy_on_device(buffer.view(-1, *shape), index, values, layers, fill)
    return buffer


def _spread_padding(
    buffer: torch.Tensor, grid: np.ndarray, places: np.ndarray, fill: RoundRobin
) -> None:
    """Overwrite the padding rows of ``buffer`` (token-major as ``grid``) round-robin by
    each token's place in the padded batch (``places``: the grid of the padded lengths)."""
    pads = np.flatnonzero(grid.reshape(-1) == PAD)
    if not pads.size:
        return
    flat = buffer.view(grid.size, *buffer.shape[-2:])
    topk = flat.shape[-1]
    place = torch.from_numpy(places.reshape(-1)[pads])
    rows = (place[:, None] * topk + torch.arange(topk)) % fill.num_experts
    at = torch.from_numpy(pads).to(flat.device)
    flat[at] = rows.to(flat.device, flat.dtype).unsqueeze(1).expand(-1, flat.shape[1], -1)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output buffer.

    On the CPU the memory is numpy's: numpy asks for transparent huge pages from 4 MiB
    (``madvise``), so writing a fresh output takes far fewer page faults than ``torch.empty``.
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.empty(shape, dtype=_OUTPUT_DTYPES[dtype]))


def _copy_on_host(
    out: np.ndarray,
    tokens: TokenRuns | TokenSegments,
    values: np.ndarray,
    layers: tuple[int, ...],
    fill: np.ndarray,
) -> None:
    """``out[s, b] = values[row, layers]`` (``fill`` at padding) for every place of the grid.

    Each long run is one slice copy (or fill); short runs (tiny samples) are gathered
    together. Segments (a seq-major grid of several columns, whose runs interleave row by
    row) are written a cache-sized block of places at a time, front to back
    (:meth:`_SegmentWriter.write`). numpy works on the calling thread: hundreds of small torch
    ops would each open a parallel region, which stalls whenever another process holds a
    core; a second thread on the copy made it slower or bimodal here (page faults and the GIL
    contend).
    """
    span = _layer_span(layers)
    pick: slice | np.ndarray = span if span is not None else np.asarray(layers, np.int64)
    step = max(1, PIECE_BYTES // max(1, out[0, 0].size * values.itemsize))

    source = values[:, span] if span is not None else values

    def rows_of(rows: slice | np.ndarray) -> np.ndarray:
        """``values[rows]`` at the expanded layers (a view for a slice of consecutive layers)."""
        return source[rows] if span is not None else values[rows][:, pick]

    if isinstance(tokens, TokenSegments):
        _SegmentWriter(out, tokens, rows_of, fill, step).write()
        return
    runs = tokens
    long = runs.count >= MIN_RUN_TOKENS
    chosen = (runs.place[long], runs.column[long], runs.row[long], runs.count[long])
    for place, column, row, count in zip(*(a.tolist() for a in chosen), strict=True):
        dest = out[place : place + count, column]
        if row == PAD:
            dest[...] = fill
            continue
        block = count if span is not None else step  # picking layers copies: bound the copy
        for at in range(0, count, block):
            end = min(count, at + block)
            np.copyto(dest[at:end], rows_of(slice(row + at, row + end)), casting="same_kind")
    _copy_short_runs(out, runs, ~long, rows_of, fill, step)


class _SegmentWriter:
    """Writes the places of a seq-major ``out`` a cache-sized block of places at a time."""

    def __init__(
        self,
        out: np.ndarray,
        segments: TokenSegments,
        rows_of: Callable[[slice | np.ndarray], np.ndarray],
        fill: np.ndarray,
        step: int,
    ) -> None:
        self.out, self.segments, self.rows_of = out, segments, rows_of
        self.fill_row, self.step = fill, step
        self.places = max(1, step // out.shape[1])
        self.edges, self.firsts = segments.bounds.tolist(), segments.first.tolist()

    def write(self) -> None:
        """Write the whole seq-major grid of several columns, front to back.

        Within a segment (:class:`TokenSegments`) each column's rows are consecutive or
        padding: a block of places is written column by column, each column one widening
        slice copy straight from the routes (or ``fill`` broadcast), so the block stays in
        cache while its strided rows fill in. Consecutive segments shorter than
        ``MIN_RUN_TOKENS`` (other than padding) are gathered row by row when there are
        enough of them (:meth:`short`).
        """
        edges, firsts = self.edges, self.firsts
        short: list[int] = []  # [begin, end) of consecutive short segments not written yet
        for k, (start, stop, starts) in enumerate(zip(edges[:-1], edges[1:], firsts, strict=True)):
            padding = max(starts) == PAD
            if not padding and stop - start < MIN_RUN_TOKENS:
                short = [short[0] if short else k, k + 1]
                continue
            if short:
                self.short(*short)
                short = []
            if padding:
                self.out[start:stop] = self.fill_row
            else:
                self.copy(start, stop, starts)
        if short:
            self.short(*short)

    def copy(self, start: int, stop: int, starts: list[int]) -> None:
        """``out[start:stop, b]`` = rows ``starts[b]`` onwards, or ``fill`` where PAD."""
        out, rows_of, fill = self.out, self.rows_of, self.fill_row
        for at in range(start, stop, self.places):
            end = min(stop, at + self.places)
            for column, row in enumerate(starts):
                if row == PAD:
                    out[at:end, column] = fill
                else:  # ids fit out: checked before
                    first = row + at - start
                    out[at:end, column] = rows_of(slice(first, first + end - at))

    def short(self, begin: int, end: int) -> None:
        """Segments ``begin:end`` (short ones): copied one by one where that takes at most
        ``GATHER_CALLS`` numpy calls, else gathered row by row."""
        if (end - begin) * self.out.shape[1] <= GATHER_CALLS:
            for k in range(begin, end):
                self.copy(self.edges[k], self.edges[k + 1], self.firsts[k])
            return
        flat = self.out[self.edges[begin] : self.edges[end]].view()
        flat.shape = (-1, *self.out.shape[2:])  # raises rather than copy: writes must land in out
        rows = self.segments.rows(begin, end).reshape(-1)
        _gather_blocks(flat, rows, self.rows_of, self.fill_row, self.step)


def _gather_blocks(
    flat: np.ndarray,
    index: np.ndarray,
    rows_of: Callable[[np.ndarray], np.ndarray],
    fill: np.ndarray,
    step: int,
) -> None:
    """``flat[i] = values[index[i], layers]`` (``fill`` at PAD), a cache-sized block at a
    time: rows and padding gathered into a block of the routes' dtype (when ``fill`` fits
    it), then written once, front to back."""
    block = np.empty((min(step, index.size), *flat.shape[1:]), dtype=rows_of(index[:0]).dtype)
    fill_fits = np.array_equal(fill.astype(block.dtype), fill)
    for at in range(0, index.size, step):
        rows = index[at : at + step]
        pads = rows == PAD
        dest = flat[at : at + rows.size]
        if pads.all():
            dest[...] = fill
        elif not pads.any():
            np.copyto(dest, rows_of(rows), casting="same_kind")
        elif fill_fits:
            staged = block[: rows.size]
            staged[~pads] = rows_of(rows[~pads])
            staged[pads] = fill
            np.copyto(dest, staged, casting="same_kind")
        else:
            np.copyto(dest, rows_of(np.where(pads, rows[~pads][0], rows)), casting="same_kind")
            dest[pads] = fill


def _copy_short_runs(
    out: np.ndarray,
    runs: TokenRuns,
    chosen: np.ndarray,
    rows_of: Callable[[np.ndarray], np.ndarray],
    fill: np.ndarray,
    step: int,
) -> None:
    """The ``chosen`` runs' places at once: padding in one assignment, rows gathered a
    cache-sized block at a time."""
    pad = chosen & runs.padding
    if pad.any():
        count = runs.count[pad]
        out[aranges(runs.place[pad], count), np.repeat(runs.column[pad], count)] = fill
    real = chosen & ~runs.padding
    if not real.any():
        return
    count = runs.count[real]
    places = aranges(runs.place[real], count)
    columns = np.repeat(runs.column[real], count)
    rows = aranges(runs.row[real], count)
    for at in range(0, rows.size, step):
        out[places[at : at + step], columns[at : at + step]] = rows_of(rows[at : at + step])


def _copy_on_device(
    flat: torch.Tensor,
    index: np.ndarray,
    values: torch.Tensor,
    layers: tuple[int, ...],
    fill: torch.Tensor,
) -> None:
    """One gather of a bounded chunk of rows at a time, then one scatter of the padding rows."""
    span = _layer_span(layers)
    source = values[:, span] if span is not None else values
    pick = None if span is not None else torch.tensor(layers, device=values.device)
    real = index != PAD
    if real.any():
        budget = min(CHUNK_BYTES, max(flat.numel() * flat.element_size() // 8, 1))
        step = max(1, budget // (source[0].numel() * source.element_size()))
        safe = np.where(real, index, 0)
        for start in range(0, index.size, step):
            rows = torch.from_numpy(safe[start : start + step]).to(values.device, non_blocking=True)
            picked = bit_view(source).index_select(0, rows)
            if pick is not None:
                picked = picked.index_select(1, pick)
            flat[start : start + step].copy_(picked.view(source.dtype))
    pads = np.flatnonzero(~real)
    if pads.size:
        flat[torch.from_numpy(pads).to(flat.device)] = fill


def _layer_span(layers: tuple[int, ...]) -> slice | None:
    """``layers`` as a slice when they are consecutive, else None."""
    first = layers[0] if layers else 0
    if layers != tuple(range(first, first + len(layers))):
        return None
    return slice(first, first + len(layers))
