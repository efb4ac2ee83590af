"""Independent references for rank-local token order, written as plain loops from the rules
(Megatron's ``get_batch_on_this_cp_rank``, Transformer Engine's THD partitioning, sequence
parallel scatter, seq-major flattening), sharing no code with ``r3data.layout``."""

from __future__ import annotations

PAD = -1


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def cp_keep(sequence: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks."""
    if cp_size == 1:
        return list(sequence)
    chunk = len(sequence) // (2 * cp_size)
    pieces = [sequence[i * chunk : (i + 1) * chunk] for i in range(2 * cp_size)]
    return pieces[cp_rank] + pieces[2 * cp_size - 1 - cp_rank]


def sp_keep(sequence: list, sp_size: int, sp_rank: int) -> list:
    part = len(sequence) // sp_size
    return sequence[sp_rank * part : (sp_rank + 1) * part]


def offsets_of(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def thd_rows(lengths, multiple, cp_size, cp_rank, sp_size, sp_rank) -> list[int]:
    """Packed row (or PAD) of every token on the rank, THD."""
    stream = []
    for offset, n in zip(offsets_of(lengths), lengths, strict=True):
        padded = [offset + p if p < n else PAD for p in range(round_up(n, multiple))]
        stream.extend(cp_keep(padded, cp_size, cp_rank))
    return sp_keep(stream, sp_size, sp_rank)


def bshd_rows(lengths, seq_len, side, cp_size, cp_rank, sp_size, sp_rank) -> list[list[int]]:
    """``[local_seq][batch]`` packed rows (or PAD), BSHD."""
    columns = []
    for offset, n in zip(offsets_of(lengths), lengths, strict=True):
        real = [offset + p for p in range(n)]
        padded = real + [PAD] * (seq_len - n) if side == "right" else [PAD] * (seq_len - n) + real
        columns.append(sp_keep(cp_keep(padded, cp_size, cp_rank), sp_size, sp_rank))
    local_seq = len(columns[0]) if columns else 0
    return [[column[s] for column in columns] for s in range(local_seq)]


def rank_rows(layout, lengths) -> list[int]:
    """The reference token order for ``layout`` (a TokenLayout), seq-major."""
    lengths = [int(n) for n in lengths]
    sp = layout.tp_size if layout.sequence_parallel else 1
    sp_rank = layout.tp_rank if layout.sequence_parallel else 0
    multiple = layout.pad_multiple or layout.tp_size * (
        2 * layout.cp_size if layout.cp_size > 1 else 1
    )
    if layout.packed:
        return thd_rows(lengths, multiple, layout.cp_size, layout.cp_rank, sp, sp_rank)
    seq_len = layout.seq_length
    if seq_len is None:
        seq_len = round_up(max(lengths, default=0), multiple)
    grid = bshd_rows(
        lengths, seq_len, layout.padding_side, layout.cp_size, layout.cp_rank, sp, sp_rank
    )
    return [row for line in grid for row in line]


def runs_of(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as ``[lo, hi)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
