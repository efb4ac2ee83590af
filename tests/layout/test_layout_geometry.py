"""TokenLayout geometry: padding, THD/BSHD, CP zigzag, SP slices, local ranges."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import rank_rows, round_up

from r3data import spans
from r3data.errors import LayoutError
from r3data.layout import PAD, ModelLayers, TokenLayout, TokenRuns, token_layout
from r3data.packed import aranges

GRIDS = st.fixed_dictionaries(
    {
        "tp_size": st.sampled_from([1, 2, 4]),
        "cp_size": st.sampled_from([1, 2, 3, 4]),
        "sequence_parallel": st.booleans(),
        "packed": st.booleans(),
        "padding_side": st.sampled_from(["left", "right"]),
        "least_multiple": st.booleans(),  # pad to the least multiple megatron allows
    }
)
LENGTHS = st.lists(st.integers(0, 40), min_size=0, max_size=6)


def layouts_of(grid: dict, **extra) -> list[TokenLayout]:
    """Every (tp, cp) rank of ``grid``."""
    grid = dict(grid)
    if grid["packed"]:
        grid["padding_side"] = "right"
    if grid.pop("least_multiple", False) and "seq_length" not in extra:
        grid["pad_multiple"] = TokenLayout(**grid).required_multiple
    return [
        TokenLayout(tp_rank=t, cp_rank=c, **grid, **extra)
        for c in range(grid["cp_size"])
        for t in range(grid["tp_size"])
    ]


@settings(max_examples=60, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS)
def test_token_order_matches_the_reference_on_every_rank(grid, lengths):
    for layout in layouts_of(grid):
        index = layout.token_index(lengths)
        assert index.tolist() == rank_rows(layout, lengths)
        assert index.size == layout.num_local_tokens(lengths)


@settings(max_examples=60, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS)
def test_every_real_token_sits_on_exactly_one_rank_in_order(grid, lengths):
    layouts = layouts_of(grid)
    total = sum(lengths)
    seen = np.zeros(total, dtype=np.int64)
    starts = np.cumsum([0, *lengths])
    for layout in layouts:
        grid_rows = layout.token_grid(lengths)
        # Without SP the TP ranks of a CP rank all see its tokens: count TP rank 0, compare.
        if layout.sequence_parallel or layout.tp_rank == 0:
            np.add.at(seen, grid_rows[grid_rows != PAD], 1)
        else:
            twin = TokenLayout(**{**layout.__dict__, "tp_rank": 0})
            assert np.array_equal(grid_rows, twin.token_grid(lengths))
        for column in grid_rows.T:
            rows = column[column != PAD]
            sample = np.searchsorted(starts, rows, side="right") - 1
            for b in np.unique(sample):
                assert np.all(np.diff(rows[sample == b]) > 0), "a sample's tokens out of order"
    assert np.all(seen == 1)
    sizes = {layout.num_local_tokens(lengths) for layout in layouts}
    assert len(sizes) <= 1, "ranks of one micro-batch must see the same number of tokens"


@settings(max_examples=50, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS)
def test_local_ranges_cover_exactly_the_real_tokens_of_the_rank(grid, lengths):
    starts = np.cumsum([0, *lengths])
    for layout in layouts_of(grid):
        ranges = layout.local_ranges(lengths)
        assert len(ranges) == len(lengths)
        covered = []
        for b, sample_ranges in enumerate(ranges):
            for (_, hi), (lo, _) in itertools.pairwise(sample_ranges):
                assert hi < lo, "ranges must be sorted, disjoint and merged"
            for lo, hi in sample_ranges:
                assert 0 <= lo < hi <= lengths[b]
                covered.extend(range(starts[b] + lo, starts[b] + hi))
        index = layout.token_index(lengths)
        assert sorted(covered) == sorted(index[index != PAD].tolist())
        assert layout.local_lengths(lengths).tolist() == [
            sum(hi - lo for lo, hi in r) for r in ranges
        ]


@settings(max_examples=40, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS)
def test_local_token_index_points_into_the_local_rows(grid, lengths):
    starts = np.cumsum([0, *lengths])
    for layout in layouts_of(grid):
        full = layout.token_index(lengths)
        local = layout.token_index(lengths, local=True)
        assert np.array_equal(full == PAD, local == PAD)
        kept = [
            starts[b] + p
            for b, sample_ranges in enumerate(layout.local_ranges(lengths))
            for lo, hi in sample_ranges
            for p in range(lo, hi)
        ]
        assert np.array_equal(
            np.asarray(kept, dtype=np.int64)[local[local != PAD]], full[full != PAD]
        )


@settings(max_examples=50, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS, local=st.booleans())
def test_token_runs_tile_the_grid_in_maximal_runs(grid, lengths, local):
    """Runs are ordered, non-empty, tile every column exactly and are never split needlessly."""
    for layout in layouts_of(grid):
        runs = layout.token_runs(lengths, local=local)
        assert (runs.local_seq, runs.columns) == layout.token_grid(lengths, local=local).shape
        assert np.all(runs.count > 0)
        for b in range(runs.columns):
            mine = runs.column == b
            ends = np.cumsum(runs.count[mine])
            assert ends[-1:].tolist() == ([runs.local_seq] if runs.local_seq else [])
            assert np.array_equal(runs.place[mine], ends - runs.count[mine])
        same = runs.column[1:] == runs.column[:-1]
        both_pad = runs.padding[1:] & runs.padding[:-1]
        continues = ~runs.padding[1:] & ~runs.padding[:-1]
        continues &= runs.row[1:] == runs.row[:-1] + runs.count[:-1]
        assert not np.any(same & (both_pad | continues)), "adjacent runs left unjoined"


PIECES = st.lists(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["pad", "next", "jump"])), max_size=6),
    min_size=1,
    max_size=3,
)


@settings(max_examples=80, deadline=None)
@given(columns=PIECES)
def test_runs_from_pieces_hold_the_pieces_rows_in_maximal_runs(columns):
    """Ordered pieces (empty ones, padding, rows that continue or jump) merge into runs that
    hold the same grid (built by a loop) and leave nothing joinable."""
    pieces, cells, row = [], [], 0
    for b, column in enumerate(columns):
        place, cells_of = 0, []
        for count, kind in column:
            row += 0 if kind == "next" else 7
            first = PAD if kind == "pad" else row
            pieces.append((b, place, first, count))
            cells_of += [PAD] * count if kind == "pad" else list(range(row, row + count))
            place, row = place + count, row + (0 if kind == "pad" else count)
        cells.append(cells_of)
    seq = max(len(c) for c in cells)
    for b, cells_of in enumerate(cells):  # pad every column to the grid's length
        pieces.append((b, len(cells_of), PAD, seq - len(cells_of)))
        cells_of += [PAD] * (seq - len(cells_of))
    array = np.array(sorted(pieces, key=lambda p: (p[0], p[1])), dtype=np.int64).T
    runs = TokenRuns.from_pieces(seq, len(columns), array.reshape(4, -1))
    assert runs.grid().T.tolist() == cells
    assert np.all(runs.count > 0)
    same = runs.column[1:] == runs.column[:-1]
    both_pad = runs.padding[1:] & runs.padding[:-1]
    continues = ~runs.padding[1:] & ~runs.padding[:-1]
    continues &= runs.row[1:] == runs.row[:-1] + runs.count[:-1]
    assert not np.any(same & (both_pad | continues))


@settings(max_examples=80, deadline=None)
@given(
    grid=GRIDS,
    lengths=LENGTHS,
    local=st.booleans(),
    fixed=st.booleans(),
    small=st.sampled_from([0, 1, 3, token_layout.SMALL_GRID, 10**6]),
)
def test_segments_cut_the_grid_wherever_a_column_stops_continuing(
    grid, lengths, local, fixed, small
):
    """Within a segment every column holds consecutive rows or padding, and a segment ends
    only where some column stops continuing (against a loop over the grid), whether cut from
    the runs or (BSHD micro-batches up to ``SMALL_GRID`` sample-pieces) straight from the
    pieces of the common length."""
    seq_length = 96 if fixed and not grid["packed"] else None  # 96: a multiple of every grid's
    for layout in layouts_of(grid, seq_length=seq_length):
        rows = layout.token_grid(lengths, local=local)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(token_layout, "SMALL_GRID", small)
            segments = layout.token_segments(lengths, local=local)
        from_runs = layout.token_runs(lengths, local=local).segments()
        assert (segments.local_seq, segments.columns) == rows.shape
        assert np.array_equal(segments.bounds, from_runs.bounds)
        assert np.array_equal(segments.first, from_runs.first)
        assert np.array_equal(segments.grid(), rows)
        count = segments.first.shape[0]
        for begin, end in ((0, count), (count // 2, count), (0, (count + 1) // 2)):
            places = rows[segments.bounds[begin] : segments.bounds[end]]
            assert np.array_equal(segments.rows(begin, end), places)
        bounds, first = segments.bounds, segments.first
        seq, columns = rows.shape
        cuts = [0] + [
            s
            for s in range(1, seq)
            if any(
                (rows[s, b] == PAD) != (rows[s - 1, b] == PAD)
                or (rows[s, b] != PAD and rows[s, b] != rows[s - 1, b] + 1)
                for b in range(columns)
            )
        ]
        assert bounds.tolist() == cuts + ([seq] if seq else [])
        assert first.shape == (len(cuts) if seq else 0, columns)
        for k in range(first.shape[0]):
            for b in range(columns):
                held = rows[bounds[k] : bounds[k + 1], b]
                expected = np.arange(first[k, b], first[k, b] + held.size)
                assert held.tolist() == (
                    [PAD] * held.size if first[k, b] == PAD else expected.tolist()
                )


@settings(max_examples=40, deadline=None)
@given(grid=GRIDS, lengths=LENGTHS.filter(bool))
def test_padded_lengths_and_offsets(grid, lengths):
    layout = layouts_of(grid)[0]
    padded = layout.padded_lengths(lengths)
    assert np.all(padded >= lengths)
    assert np.all(padded % layout.required_multiple == 0)
    if layout.packed:
        assert padded.tolist() == [round_up(n, layout.multiple) for n in lengths]
    else:
        assert set(padded.tolist()) == {round_up(max(lengths), layout.multiple)}
    assert layout.cu_seqlens(lengths).tolist() == np.cumsum([0, *lengths]).tolist()
    assert layout.cu_seqlens_padded(lengths).tolist() == np.cumsum([0, *padded]).tolist()


def test_default_pad_multiple_follows_tp_and_cp():
    assert TokenLayout(tp_size=4).multiple == 4
    assert TokenLayout(tp_size=2, cp_size=3).multiple == 12
    assert TokenLayout(tp_size=2, cp_size=2, pad_multiple=64).multiple == 64


def test_seq_length_fixes_the_bshd_length():
    layout = TokenLayout(packed=False, cp_size=2, cp_rank=1, seq_length=16)
    assert layout.padded_lengths([3, 9]).tolist() == [16, 16]
    assert layout.token_index([3, 9]).tolist() == rank_rows(layout, [3, 9])
    with pytest.raises(LayoutError, match="fit seq_length 16, found 17"):
        layout.token_index([17])


def test_left_padding_keeps_the_last_tokens_at_the_end():
    layout = TokenLayout(packed=False, padding_side="left")
    assert layout.token_grid([2, 4]).tolist() == [[PAD, 2], [PAD, 3], [0, 4], [1, 5]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, r"tp_size: expected an int in \[1, 2147483647\], found 0"),
        ({"cp_size": 2**70}, r"cp_size: expected an int in \[1, 2147483647\]"),
        ({"tp_size": 2**20, "cp_size": 2**12}, "padding multiple is at most 2147483647, found"),
        (
            {"tp_size": 2**30, "cp_size": 4, "sequence_parallel": True},
            "padding multiple is at most 2147483647, found 8589934592",
        ),
        ({"tp_size": 2, "tp_rank": 2}, r"tp_rank must be in \[0, 2\), found 2"),
        ({"cp_rank": -1}, r"cp_rank must be in \[0, 1\), found -1"),
        ({"pp_size": 2, "pp_rank": 3}, r"pp_rank must be in \[0, 2\), found 3"),
        ({"vpp_size": 2}, "vpp_size=2"),
        ({"padding_side": "middle", "packed": False}, "'left' or 'right', found 'middle'"),
        ({"padding_side": "left"}, "pad each sample on the right"),
        ({"seq_length": 8}, "seq_length is for BSHD"),
        ({"cp_size": 2, "pad_multiple": 6}, "multiple of 4 .* found 6"),
        ({"tp_size": 2, "sequence_parallel": True, "pad_multiple": 3}, "multiple of 2 .* found 3"),
        # 2*CP and CP*TP: lcm(4, 6) = 12 at CP 2 x TP 3 with SP
        ({"cp_size": 2, "tp_size": 3, "sequence_parallel": True, "pad_multiple": 6}, "of 12 .*6"),
        ({"packed": False, "cp_size": 2, "seq_length": 6}, "seq_length must be .* multiple of 4"),
        ({"layers": 4}, "layers must be a ModelLayers, found int"),
    ],
)
def test_invalid_layouts_raise(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        TokenLayout(**kwargs)


def test_the_least_multiple_is_megatrons():
    """CP 2 x TP 2 with SP needs whole chunks (4) and whole SP slices of each rank's half (4):
    NeMo-RL pads BSHD to 4 there, which megatron takes."""
    layout = TokenLayout(cp_size=2, tp_size=2, sequence_parallel=True, pad_multiple=4)
    assert layout.required_multiple == 4
    assert TokenLayout(cp_size=2, tp_size=3, sequence_parallel=True).required_multiple == 12
    assert TokenLayout(cp_size=3, tp_size=2).required_multiple == 6  # no SP: chunks only


def test_vpp_of_one_is_accepted():
    assert TokenLayout(vpp_size=1, pp_size=2).vpp_size == 1


@pytest.mark.parametrize(
    ("lengths", "message"),
    [([[1, 2]], "1-D integer array"), ([1.5], "1-D integer array"), ([3, -1], ">= 0, found -1")],
)
def test_bad_lengths_raise(lengths, message):
    with pytest.raises(LayoutError, match=message):
        TokenLayout().token_index(lengths)


def test_moe_layers_map_the_route_axis_to_this_stage():
    layers = ModelLayers(num_layers=6, moe_layer_freq=(1, 0, 1, 1, 0, 1))
    first = TokenLayout(pp_size=2, pp_rank=0, layers=layers)
    second = TokenLayout(pp_size=2, pp_rank=1, layers=layers)
    assert first.moe_layers(6, "all") == (0, 2)
    assert second.moe_layers(6, "all") == (3, 5)
    assert first.moe_layers(4, "moe") == (0, 1)
    assert second.moe_layers(4, "moe") == (2, 3)
    with pytest.raises(LayoutError, match=r"routes hold 4 layers; layer_axis='all' .* expects 6"):
        first.moe_layers(4, "all")
    with pytest.raises(LayoutError, match="'all' or 'moe', found 'dense'"):
        first.moe_layers(6, "dense")  # type: ignore[arg-type]


def test_without_model_layers_every_route_layer_is_moe_and_split_evenly():
    assert TokenLayout(pp_size=2, pp_rank=1).moe_layers(8, "all") == (4, 5, 6, 7)
    with pytest.raises(LayoutError, match="split evenly"):
        TokenLayout(pp_size=3).moe_layers(8, "moe")


@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 20)), min_size=0, max_size=8))
def test_aranges_concatenates_ranges(runs):
    """The one vectorised ``aranges`` (``r3data.packed``) that layout's geometry builds on."""
    starts = np.array([s for s, _ in runs], dtype=np.int64)
    counts = np.array([n for _, n in runs], dtype=np.int64)
    got = aranges(starts, counts)
    assert got.dtype == np.int64
    assert got.tolist() == [p for s, n in runs for p in range(s, s + n)]


def test_span_algebra_is_shared_with_the_trace_code():
    trace_builder = importlib.import_module("r3data.trace.builder")
    trace_stitch = importlib.import_module("r3data.trace.stitch")
    assert trace_builder.merge is spans.merge
    assert trace_stitch.complement is spans.complement
    assert trace_stitch.intersect is spans.intersect
    assert trace_stitch.format_spans is spans.format_spans
    layout = TokenLayout(cp_size=2, cp_rank=0, packed=False, seq_length=8)
    # chunks 0 and 3 of a length-8 sequence: [0, 2) and [6, 8); sample of 7 keeps [6, 7)
    assert layout.local_ranges([7]) == [[(0, 2), (6, 7)]]
