"""Expand packed routes into the per-layer, rank-local tensors a trainer's routers replay.

``expand`` gives Megatron's form: one ``[local_tokens, topk]`` tensor per MoE layer of this
pipeline stage, tokens in router order (see :class:`~r3data.layout.TokenLayout`). ``dense``
gives ``[B, local_seq, topk]`` per layer for batch-major routers (FSDP, torchtitan-style MoE).

Every row is read once from the packed values into one token-major output buffer
``[tokens, layers, topk]`` on the routes' device; the per-layer tensors are views of it (row
stride ``layers * topk``; ``torch.gather``/``scatter`` take them as they are). On the CPU long
runs of consecutive rows are slice copies; otherwise, and on accelerators, a gather runs a
bounded chunk of rows at a time. There is no padded full-batch rectangle and no full-size
intermediate. Padding tokens get ``fill``, by default ``arange(topk)``: the all-to-all
dispatcher assumes exactly ``tokens * topk`` distinct assignments, so a padding row must never
repeat an expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from r3data.errors import LayoutError
from r3data.layout.token_layout import PAD, LayerAxis, TokenLayout, as_lengths
from r3data.packed import PackedTensor
from r3data.tensor_buffer import bit_view

Fill = Literal["distinct"] | Sequence[int] | torch.Tensor

#: Intermediate rows held at once stay under this many bytes (and 1/8 of the output).
CHUNK_BYTES = 64 << 20
#: On the CPU, runs of consecutive rows this long on average are copied slice by slice
#: (memory bandwidth); shorter runs, and other devices, take one chunked gather.
MIN_RUN_TOKENS = 32

_ROUTE_DTYPES = (torch.uint8, torch.int16, torch.uint16, torch.int32, torch.int64)


def expand(
    routes: PackedTensor,
    layout: TokenLayout,
    *,
    fill: Fill = "distinct",
    dtype: torch.dtype = torch.int32,
    layer_axis: LayerAxis = "all",
    local: bool = False,
    lengths: Any = None,
) -> list[torch.Tensor]:
    """One ``[local_tokens, topk]`` tensor per MoE layer this rank's stage builds, in order.

    The tensors are views of one token-major buffer on the routes' device; expand on the
    trainer's GPU so that Megatron's per-layer ``.to(scores.device)`` moves nothing.

    ``routes`` rows are ``[layers, topk]``; ``layer_axis`` says whether ``layers`` counts every
    decoder layer (``"all"``, as vLLM and SGLang report) or only MoE layers (``"moe"``).
    With ``local=True`` segment i of ``routes`` holds just the rows of sample i's
    ``layout.local_ranges(lengths)`` back to back, and ``lengths`` (the full sample lengths)
    is required; the result equals expanding the full routes.
    """
    topk = _check_routes(routes)
    grid = layout.token_grid(_full_lengths(routes, layout, local, lengths), local=local)
    layers = layout.moe_layers(routes.row_shape[0], layer_axis)
    buffer = _gather(
        routes.values, grid, layers, _fill_row(fill, topk), _int_dtype(dtype), batch_major=False
    )
    return list(buffer.view(grid.size, len(layers), topk).unbind(1))


def dense(
    routes: PackedTensor,
    layout: TokenLayout | None = None,
    *,
    fill: Fill = "distinct",
    dtype: torch.dtype = torch.int32,
    layer_axis: LayerAxis = "all",
    local: bool = False,
    lengths: Any = None,
) -> list[torch.Tensor]:
    """One ``[B, local_seq, topk]`` tensor per local MoE layer, batch-major (BSHD layouts).

    The default layout is a single rank with right padding to the longest sample.
    """
    layout = TokenLayout(packed=False) if layout is None else layout
    topk = _check_routes(routes)
    if layout.packed:
        raise LayoutError("dense needs a BSHD layout (packed=False), found THD")
    grid = layout.token_grid(_full_lengths(routes, layout, local, lengths), local=local)
    layers = layout.moe_layers(routes.row_shape[0], layer_axis)
    buffer = _gather(
        routes.values, grid, layers, _fill_row(fill, topk), _int_dtype(dtype), batch_major=True
    )
    return list(buffer.unbind(2))


def expand_mask(
    mask: PackedTensor, layout: TokenLayout, *, local: bool = False, lengths: Any = None
) -> torch.Tensor:
    """A per-token mask (``[rows]`` or ``[rows, 1]``) in router order; padding is False."""
    if not isinstance(mask, PackedTensor):
        raise LayoutError(f"mask must be a PackedTensor, found {type(mask).__name__}")
    if mask.row_shape not in ((), (1,)):
        raise LayoutError(f"mask rows must be scalars, found row shape {mask.row_shape}")
    index = layout.token_index(_full_lengths(mask, layout, local, lengths), local=local)
    flat = mask.values.reshape(-1).bool()
    real = index != PAD
    if not real.any():
        return torch.zeros(index.size, dtype=torch.bool, device=flat.device)
    rows = torch.from_numpy(np.where(real, index, 0)).to(flat.device)
    return flat.index_select(0, rows) & torch.from_numpy(real).to(flat.device)


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
    """The full sample lengths, checked against the rows ``field`` holds."""
    if lengths is None:
        if local:
            raise LayoutError("local=True needs lengths: the full length of every sample")
        return field.lengths
    full = as_lengths(lengths)
    expected, what = (layout.local_lengths(full), "local rows") if local else (full, "rows")
    found = field.lengths
    if found.size != expected.size:
        raise LayoutError(f"lengths name {expected.size} samples, the batch holds {found.size}")
    wrong = np.flatnonzero(found != expected)
    if wrong.size:
        at = int(wrong[0])
        raise LayoutError(
            f"sample {at} must hold {int(expected[at])} {what}, found {int(found[at])}"
        )
    return full


def _fill_row(fill: Fill, topk: int) -> torch.Tensor:
    if isinstance(fill, str):
        if fill != "distinct":
            raise LayoutError(
                f"fill must be 'distinct' or {topk} distinct expert ids, found {fill!r}"
            )
        return torch.arange(topk)
    row = torch.as_tensor(fill)
    if row.dtype.is_floating_point or row.dtype == torch.bool or row.shape != (topk,):
        raise LayoutError(f"fill must hold {topk} integer expert ids, found {fill!r}")
    row = row.to(torch.int64)
    if int(row.min()) < 0 or row.unique().numel() != topk:
        raise LayoutError(f"fill must hold {topk} distinct expert ids >= 0, found {row.tolist()}")
    return row


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    if (
        not isinstance(dtype, torch.dtype)
        or dtype.is_floating_point
        or dtype.is_complex
        or dtype == torch.bool
    ):
        raise LayoutError(f"dtype must be an integer torch dtype, found {dtype!r}")
    return dtype


# --- the gather ----------------------------------------------------------------------------


def _gather(
    values: torch.Tensor,
    grid: np.ndarray,
    layers: tuple[int, ...],
    fill_row: torch.Tensor,
    dtype: torch.dtype,
    *,
    batch_major: bool,
) -> torch.Tensor:
    """A token-major buffer with ``[s, b, j] = values[grid[s, b], layers[j]]`` (``fill_row`` at PAD).

    The buffer is ``[S, B, L, K]``, or ``[B, S, L, K]`` when ``batch_major``.
    """
    seq, batch = grid.shape
    shape = (len(layers), values.shape[2])
    buffer = torch.empty(
        (batch, seq, *shape) if batch_major else (seq, batch, *shape),
        dtype=dtype,
        device=values.device,
    )
    if not buffer.numel():
        return buffer
    source, pick = _layer_source(values, layers)
    fill = fill_row.to(buffer.device, dtype).expand(shape)
    if not values.shape[0]:
        buffer.copy_(fill.expand_as(buffer))
        return buffer
    budget = min(CHUNK_BYTES, max(buffer.numel() * buffer.element_size() // 8, 1))
    step = max(1, budget // (source[0].numel() * source.element_size()))
    runs = _runs(grid)
    if values.device.type == "cpu" and runs[0].size * MIN_RUN_TOKENS <= grid.size:
        dest = buffer.transpose(0, 1) if batch_major else buffer
        _copy_runs(dest, runs, source, pick, fill, step)
    else:
        flat = (grid.T if batch_major else grid).reshape(-1)
        _copy_rows(buffer.view(-1, *shape), flat, source, pick, fill, step)
    return buffer


def _layer_source(
    values: torch.Tensor, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers to read: a view when they are one span, else all rows plus the picks."""
    first = layers[0] if layers else 0
    if layers == tuple(range(first, first + len(layers))):
        return values[:, first : first + len(layers)], None
    return values, torch.tensor(layers, device=values.device)


def _rows(source: torch.Tensor, pick: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``source[rows]`` restricted to the picked layers, in the source dtype."""
    picked = bit_view(source).index_select(0, rows)
    if pick is not None:
        picked = picked.index_select(1, pick)
    return picked.view(source.dtype)


def _runs(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs down each column of ``grid``: (column, first s, length, first row or PAD).

    A run is consecutive rows (``+1`` per step) or consecutive padding.
    """
    seq = grid.shape[0]
    flat = grid.T.reshape(-1)
    pad = flat == PAD
    cut = np.ones(flat.size, dtype=bool)
    cut[1:] = (pad[1:] != pad[:-1]) | (~pad[1:] & (flat[1:] != flat[:-1] + 1))
    cut[::seq] = True
    starts = np.flatnonzero(cut)
    counts = np.diff(np.append(starts, flat.size))
    return starts // seq, starts % seq, counts, flat[starts]


def _copy_runs(
    dest: torch.Tensor,
    runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    source: torch.Tensor,
    pick: torch.Tensor | None,
    fill: torch.Tensor,
    step: int,
) -> None:
    """One slice copy per run, through numpy views of the CPU tensors.

    numpy copies on the calling thread: hundreds of small torch copies would each open a
    parallel region, which stalls whenever another process holds a core.
    """
    out, values, fill_rows = dest.numpy(), source.numpy(), fill.numpy()
    picks = None if pick is None else pick.cpu().numpy()
    piece = step if picks is not None else None
    for column, first, count, row in zip(*(r.tolist() for r in runs), strict=True):
        if row == PAD:
            out[first : first + count, column] = fill_rows
            continue
        for offset in range(0, count, piece or count):
            n = min(count - offset, piece or count)
            block = values[row + offset : row + offset + n]
            block = block if picks is None else block[:, picks]
            np.copyto(out[first + offset : first + offset + n, column], block, casting="unsafe")


def _copy_rows(
    flat_dest: torch.Tensor,
    index: np.ndarray,
    source: torch.Tensor,
    pick: torch.Tensor | None,
    fill: torch.Tensor,
    step: int,
) -> None:
    """One gather, ``step`` tokens at a time, then the padding rows."""
    real = index != PAD
    safe = np.where(real, index, 0)
    for start in range(0, index.size, step):
        rows = torch.from_numpy(safe[start : start + step]).to(source.device, non_blocking=True)
        flat_dest[start : start + step].copy_(_rows(source, pick, rows))
    pads = np.flatnonzero(~real)
    if pads.size:
        flat_dest[torch.from_numpy(pads).to(source.device)] = fill
