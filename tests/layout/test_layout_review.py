"""Adversarial review of the layout fast paths: expand against a per-token reference over
every geometry, staging blocks and segment edges at their boundaries, the BSHD piece cache,
repeated calls, and bad geometry (typed errors, never a wrap or a numpy error)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import PAD, rank_rows
from test_layout_expand import all_ranks

from r3data.errors import LayoutError
from r3data.layout import (
    ModelLayers,
    RankRows,
    TokenLayout,
    expand,
    expand_batch_major,
    gather,
    token_layout,
)
from r3data.layout.token_layout import _sequence_pieces
from r3data.packed import PackedTensor

INT32_MAX = 2**31 - 1


def routes_of(lengths, layers=2, topk=2, dtype=torch.int32, seed=0) -> PackedTensor:
    rng = np.random.default_rng(seed)
    values = rng.integers(1, 100, size=(sum(lengths), layers, topk))
    return PackedTensor.from_lengths(torch.from_numpy(values).to(dtype), lengths)


ROUTE_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64]


def random_values(rows, layers, topk, dtype, rng, strided=False) -> torch.Tensor:
    """Ids in the upper range ``dtype`` holds (sign and widening bugs show), optionally a
    strided view (every other top-k entry of a wider tensor, layers offset by one)."""
    high = min(torch.iinfo(dtype).max, 5000)
    shape = (rows, layers + 2, 2 * topk) if strided else (rows, layers, topk)
    values = torch.from_numpy(rng.integers(high // 2, high + 1, size=shape)).to(dtype)
    return values[:, 1 : layers + 1, ::2] if strided else values


def expected(values: torch.Tensor, rows: list[int], layer_ids, fill) -> list[np.ndarray]:
    """Per token, per layer: the row's ids, or ``fill`` for padding (a plain loop)."""
    source = values.to(torch.int64).numpy()
    return [
        np.array(
            [source[r, layer] if r != PAD else np.asarray(fill) for r in rows], dtype=np.int64
        ).reshape(len(rows), values.shape[2])
        for layer in layer_ids
    ]


def local_read(routes: PackedTensor, layout: TokenLayout, lengths) -> RankRows:
    """What a rank-local read holds, built from ``local_ranges`` by slicing each sample."""
    ranges = layout.local_ranges(lengths)
    parts = [
        torch.cat([sample[lo:hi] for lo, hi in spans] or [sample[:0]])
        for sample, spans in zip(routes, ranges, strict=True)
    ]
    rows = PackedTensor.from_segments(parts) if parts else routes
    return RankRows(rows.values, rows.cu_seqlens, layout=layout, full_lengths=lengths)


LENGTHS = st.lists(
    st.one_of(st.integers(0, 2), st.integers(29, 35), st.integers(0, 200)), min_size=0, max_size=5
)
GEOMETRIES = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "cp": st.sampled_from([1, 2, 3]),
        "sp": st.booleans(),
        "packed": st.booleans(),
        "side": st.sampled_from(["left", "right"]),
        "pad_factor": st.sampled_from([None, 1, 3]),
        "extra_length": st.sampled_from([None, 0, 1]),  # BSHD seq_length: longest + k multiples
        "lengths": LENGTHS,
        "pattern": st.one_of(st.none(), st.lists(st.booleans(), min_size=1, max_size=6)),
        "topk": st.integers(1, 4),
        "dtype": st.sampled_from(ROUTE_DTYPES),
        "out": st.sampled_from([torch.int32, torch.int64]),
        "fill": st.sampled_from(["distinct", "wide", "narrow"]),
        "strided": st.booleans(),
        "local": st.booleans(),
        "sizes": st.sampled_from(
            [
                {},
                {"PIECE_BYTES": 1},
                {"PIECE_BYTES": 97, "MIN_RUN_TOKENS": 3},
                {"PIECE_BYTES": 211, "MIN_RUN_TOKENS": 1, "GATHER_CALLS": 0},
                {"MIN_RUN_TOKENS": 1000, "GATHER_CALLS": 1000},
            ]
        ),
    }
)


def layout_kwargs(case) -> dict:
    """The geometry's padding options: an overridden multiple, a fixed BSHD length."""
    tp, cp, sp, packed = case["tp"], case["cp"], case["sp"], case["packed"]
    need = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    pad_multiple = None if case["pad_factor"] is None else need * case["pad_factor"]
    kwargs = {"pad_multiple": pad_multiple, "side": case["side"]}
    if not packed and case["extra_length"] is not None:
        longest = max(case["lengths"], default=0)
        kwargs["seq_length"] = (-(-longest // need) + case["extra_length"]) * need
    return kwargs


@settings(max_examples=60, deadline=None)
@given(case=GEOMETRIES, seed=st.integers(0, 2**16))
def test_expand_matches_a_per_token_reference_on_every_rank_and_geometry(case, seed):
    """Every rank of every (TP, CP, SP, THD/BSHD, padding) geometry, ragged micro-batches with
    empty and one-token samples and segments about MIN_RUN_TOKENS long, dense layers between
    MoE ones, fills the routes' dtype cannot hold, every route and output dtype, strided
    sources, rank-local reads, and staging blocks and gathers cut to a few bytes: ``expand``
    and ``expand_batch_major`` equal a per-token loop over the rows each rank holds."""
    rng = np.random.default_rng(seed)
    lengths, topk = case["lengths"], case["topk"]
    pattern = case["pattern"]
    layers = None
    if pattern is not None:
        pattern = [True, *pattern[1:]]
        layers = ModelLayers(num_layers=len(pattern), moe_layer_freq=tuple(map(int, pattern)))
    num_layers = len(pattern) if pattern else 3
    values = random_values(sum(lengths), num_layers, topk, case["dtype"], rng, case["strided"])
    routes = PackedTensor.from_lengths(values, lengths)
    layer_ids = layers.moe_layer_ids if layers else range(num_layers)
    fill = {
        "distinct": "distinct",
        "wide": [300 + 7 * i for i in range(topk)][::-1],  # beyond uint8 and int8
        "narrow": list(rng.permutation(8)[:topk]),
    }[case["fill"]]
    fill_row = np.arange(topk) if fill == "distinct" else np.asarray(fill)
    ranks = all_ranks(
        case["tp"], case["cp"], case["sp"], case["packed"], layers=layers, **layout_kwargs(case)
    )
    with pytest.MonkeyPatch.context() as patch:
        for name, value in case["sizes"].items():
            patch.setattr(gather, name, value)
        for layout in ranks:
            rows = rank_rows(layout, lengths)
            want = expected(values, rows, layer_ids, fill_row)
            field = local_read(routes, layout, lengths) if case["local"] else routes
            got = expand(field, layout, fill=fill, dtype=case["out"])
            assert len(got) == len(want)
            for tensor, array in zip(got, want, strict=True):
                assert tensor.dtype == case["out"]
                np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))
            if layout.packed:
                continue
            batch = len(lengths)
            got = expand_batch_major(field, layout, fill=fill, dtype=case["out"])
            for tensor, array in zip(got, want, strict=True):
                seq = array.shape[0] // batch if batch else 0
                array = array.reshape(seq, batch, topk).transpose(1, 0, 2)
                np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))


def staging_places(layers: int, topk: int, dtype: torch.dtype, batch: int) -> int:
    """Places of a seq-major grid one block of writes holds (``_SegmentWriter``'s rule)."""
    row_bytes = layers * topk * torch.empty((), dtype=dtype).element_size()
    return max(1, gather.PIECE_BYTES // row_bytes // batch)


@pytest.mark.parametrize(
    ("layers", "topk", "dtype"),
    [(48, 8, torch.int32), (61, 8, torch.uint8), (27, 6, torch.int16)],
)
@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_runs_ending_at_staging_block_and_segment_edges(layers, topk, dtype, shift):
    """At real sizes (no patched constants), samples end one place before, at and after a
    staging block's edge (and two blocks'), and segments run MIN_RUN_TOKENS +- 1 places:
    every rank's rows equal the reference."""
    batch = 4
    places = staging_places(layers, topk, dtype, batch)
    edge = gather.MIN_RUN_TOKENS
    lengths = [4 * places + shift, 4 * places + shift, places + shift + edge - 1, edge + shift]
    rng = np.random.default_rng(places)
    values = random_values(sum(lengths), layers, topk, dtype, rng)
    routes = PackedTensor.from_lengths(values, lengths)
    for layout in [
        TokenLayout(packed=False),
        TokenLayout(packed=False, padding_side="left", seq_length=4 * places + 2),
        *all_ranks(2, 2, True, False, "left"),
        *all_ranks(1, 3, False, False),
    ]:
        rows = rank_rows(layout, lengths)
        want = expected(values, rows, range(layers), np.arange(topk))
        for tensor, array in zip(expand(routes, layout), want, strict=True):
            np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))


def test_the_piece_cache_serves_equal_layouts_and_stays_unchanged_across_calls():
    """Cached BSHD pieces are shared by equal layouts (one built from numpy integers) and by
    micro-batches of one common length; interleaved calls over ranks and lengths, and calls
    after the cache was emptied, all equal the reference, and no call writes the cache."""
    _sequence_pieces.cache_clear()
    plain = all_ranks(2, 2, True, False)
    numpy_built = [
        TokenLayout(
            tp_size=np.int64(2),
            tp_rank=np.int64(layout.tp_rank),
            cp_size=np.int32(2),
            cp_rank=np.int32(layout.cp_rank),
            sequence_parallel=np.bool_(True),
            packed=np.bool_(False),
        )
        for layout in plain
    ]
    assert numpy_built == plain
    assert [hash(a) for a in numpy_built] == [hash(b) for b in plain]
    batches = [[40, 3, 0], [38, 40], [17, 1, 44, 9], [40, 3, 0]]  # common lengths 40, 40, 48
    routes = {i: routes_of(lengths, layers=3, topk=2, seed=i) for i, lengths in enumerate(batches)}
    results = {}
    for round_ in range(2):
        for i, lengths in enumerate(batches):
            for layout in plain + numpy_built:
                rows = rank_rows(layout, lengths)
                got = expand(routes[i], layout, fill=[5, 3])
                want = expected(routes[i].values, rows, range(3), [5, 3])
                for tensor, array in zip(got, want, strict=True):
                    np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))
                key = (i, plain.index(layout))
                if key in results:
                    assert all(torch.equal(a, b) for a, b in zip(results[key], got, strict=True))
                results[key] = got
        if round_ == 0:
            cached = {layout: [a.copy() for a in _sequence_pieces(layout, 40)] for layout in plain}
            assert _sequence_pieces.cache_info().currsize == len(plain) * 2  # lengths 40, 48
            _sequence_pieces.cache_clear()
    for layout, arrays in cached.items():
        for fresh, kept in zip(_sequence_pieces(layout, 40), arrays, strict=True):
            assert not fresh.flags.writeable
            np.testing.assert_array_equal(fresh, kept)


def test_outputs_of_repeated_calls_are_fresh_buffers():
    """Staging buffers and cached pieces never leak between calls: writing one call's output
    leaves the next call's (same routes, other fills) as the reference says."""
    lengths = [70, 3, 0, 65]
    routes = routes_of(lengths, layers=4, topk=3, dtype=torch.uint8)
    layout = TokenLayout(packed=False, cp_size=2, cp_rank=1, padding_side="left")
    rows = rank_rows(layout, lengths)
    for fill in ([300, 301, 302], [0, 1, 2], "distinct", [9, 8, 7]):
        first = expand(routes, layout, fill=fill)
        for tensor in first:
            tensor.fill_(-1)
        row = np.arange(3) if fill == "distinct" else fill
        want = expected(routes.values, rows, range(4), row)
        for tensor, array in zip(expand(routes, layout, fill=fill), want, strict=True):
            np.testing.assert_array_equal(tensor.numpy(), array)


# --- bad geometry: typed errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"packed": "false"}, "packed must be a bool, found 'false'"),
        ({"tp_size": 2, "sequence_parallel": None}, "sequence_parallel must be a bool, found None"),
        ({"pad_multiple": True}, "pad_multiple must be a positive multiple of 1 .* found True"),
        ({"packed": False, "seq_length": True}, "seq_length must be .* found True"),
        ({"pad_multiple": 2**31}, r"pad_multiple must be .* at most 2\*\*31-1, found 2147483648"),
        ({"packed": False, "seq_length": 2**63}, r"at most 2\*\*31-1, found 9223372036854775808"),
    ],
)
def test_layouts_refuse_non_bool_flags_bool_sizes_and_sizes_beyond_int32(kwargs, message):
    """``packed="false"`` was THD, ``pad_multiple=True`` a multiple of 1, and 2**63 an
    OverflowError deep in numpy."""
    with pytest.raises(LayoutError, match=message):
        TokenLayout(**kwargs)


def test_numpy_integer_sizes_and_ranks_are_plain_ints():
    """``tp_rank=np.int64(1)`` of ``tp_size=np.int64(2)`` was refused as out of [0, 2); an
    ``np.int8`` CP size of 100 wrapped ``2 * cp_size`` to -56."""
    layout = TokenLayout(tp_size=np.int64(2), tp_rank=np.int64(1), sequence_parallel=True)
    assert layout == TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True)
    assert type(layout.tp_size) is int
    assert type(layout.tp_rank) is int
    wide = TokenLayout(cp_size=np.int8(100), cp_rank=np.int8(99), packed=False)
    assert wide.multiple == 200
    grid = wide.token_grid([200])
    assert grid.reshape(-1).tolist() == [99, 100]  # chunks 99 and 100 of 200


@pytest.mark.parametrize(
    ("layout", "lengths"),
    [
        (TokenLayout(packed=False, pad_multiple=2**30), [3, 2, 1]),  # 3 * 2**30 tokens
        (TokenLayout(pad_multiple=2**30), [3, 2]),
        (TokenLayout(), [2**62, 2**62]),  # rounding and sums wrapped int64
        (TokenLayout(cp_size=2), [2**63 - 1]),
        (TokenLayout(packed=False, tp_size=2), [2**63 - 1]),
    ],
)
def test_micro_batches_beyond_int32_tokens_raise_before_any_allocation(layout, lengths):
    """A micro-batch's padded tokens must fit int32 (cu_seqlens_padded, as its rows do); past
    that, rounding wrapped int64 (negative dimensions) or numpy tried to allocate TiBs."""
    with pytest.raises(LayoutError, match=r"at most 2\*\*31-1 padded tokens .*found \d+"):
        layout.token_grid(lengths)
    with pytest.raises(LayoutError, match=r"at most 2\*\*31-1 padded tokens"):
        layout.local_ranges(lengths)


def test_expand_refuses_a_padding_multiple_beyond_int32_tokens():
    with pytest.raises(LayoutError, match=r"at most 2\*\*31-1 padded tokens .*found 3221225472"):
        expand(routes_of([3, 2, 1]), TokenLayout(packed=False, pad_multiple=2**30))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 2, "moe_layer_freq": [1.7, 0]}, r"2 flags of 0 or 1, found \[1.7, 0\]"),
        ({"num_layers": 2, "moe_layer_freq": [1, "a"]}, "2 flags of 0 or 1, found"),
        ({"num_layers": 2, "stage_layers": 5}, "stage_layers must be a sequence of stages"),
        ({"num_layers": 2, "stage_layers": [[0], ["x"]]}, "stage_layers must .* found"),
        ({"num_layers": 2, "stage_layers": [[0.0], [1]]}, "stage_layers must .* found"),
    ],
)
def test_model_layers_refuse_flags_and_ids_that_are_not_ints(kwargs, message):
    """A flag of 1.7 was truncated to 1 (an MoE layer) and a layer id 0.0 to 0; strings and
    non-sequences raised ValueError / TypeError from ``int()``."""
    with pytest.raises(LayoutError, match=message):
        ModelLayers(**kwargs)


def test_model_layers_keep_bool_and_numpy_flags():
    layers = ModelLayers(num_layers=3, moe_layer_freq=[True, np.int64(0), 1])
    assert layers.moe_layer_freq == (1, 0, 1)


def test_stage_rank_refuses_a_bool():
    with pytest.raises(LayoutError, match=r"pp_rank must be in \[0, 2\), found True"):
        ModelLayers(num_layers=4).stage(2, True)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4)),
    dtype=st.sampled_from(ROUTE_DTYPES),
    strided=st.booleans(),
    data=st.data(),
)
def test_dense_layers_are_found_whatever_zero_bytes_the_first_row_holds(
    shape, dtype, strided, data
):
    """Ids of 0, 1, 256 and -1 put runs of zero bytes across ids and layers of the first row
    (where a quick look for a layer's worth of zero bytes finds them but no layer is zero,
    and where it does): ``expand`` refuses exactly the layers that are zero in every row
    (top-k >= 2), whatever the dtype, whether the rows are strided."""
    rows, layers, topk = shape
    info = torch.iinfo(dtype)
    ids = [v for v in (0, 1, 256, -1) if info.min <= v <= info.max]
    flat = data.draw(
        st.lists(st.sampled_from(ids), min_size=rows * layers * topk, max_size=rows * layers * topk)
    )
    values = torch.tensor(flat, dtype=torch.int64).reshape(shape).to(dtype)
    if strided:
        wide = torch.ones((rows, layers, 2 * topk), dtype=dtype)
        wide[:, :, ::2] = values
        values = wide[:, :, ::2]
    zero = [layer for layer in range(layers) if topk >= 2 and not values[:, layer].any()]
    routes = PackedTensor.from_lengths(values, [rows])
    if not zero:
        expand(routes, TokenLayout(), fill=list(range(1000, 1000 + topk)))
        return
    with pytest.raises(LayoutError, match=rf"layers \[{', '.join(map(str, zero))}\] of the"):
        expand(routes, TokenLayout())


@settings(max_examples=40, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    side=st.sampled_from(["left", "right"]),
    extra_length=st.sampled_from([None, 0, 2]),
    lengths=st.lists(
        st.one_of(st.integers(0, 3), st.integers(0, 40), st.integers(0, 1500)),
        min_size=1,
        max_size=20,
    ),
    topk=st.integers(1, 3),
    dtype=st.sampled_from(ROUTE_DTYPES),
    out=st.sampled_from([torch.int32, torch.int64]),
    source=st.sampled_from(["offset", "row_strided", "picked"]),
    edge_fill=st.booleans(),
    local=st.booleans(),
    small_grid=st.sampled_from([None, 0, 15, 17]),
    seed=st.integers(0, 2**16),
)
def test_expand_of_micro_batches_past_the_small_grid_matches_the_reference(
    cp, tp, sp, side, extra_length, lengths, topk, dtype, out, source, edge_fill, local,
    small_grid, seed,
):  # fmt: skip
    """Up to 20 samples (grids past ``SMALL_GRID``, cut from the runs) and CP 4, at real block
    sizes: sources at a storage offset, strided between rows or expanded at every other
    layer, fills at the output dtype's top, rank-local reads: ``expand`` and
    ``expand_batch_major`` equal a per-token loop on every rank."""
    rng = np.random.default_rng(seed)
    need = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    kwargs = {"side": side}
    if extra_length is not None:
        kwargs["seq_length"] = (-(-max(lengths) // need) + extra_length) * need
    num_layers, rows = 3, sum(lengths)
    wide = random_values(2 * rows + 3, num_layers, 2 * topk, dtype, rng)
    values = {
        "offset": wide[3 : 3 + rows, :, 1::2],
        "row_strided": wide[::2][:rows, :, :topk],
        "picked": wide[:rows, :, :topk],
    }[source]
    layer_ids = range(num_layers)
    if source == "picked":  # layers 0 and 2: not a slice
        kwargs["layers"] = ModelLayers(num_layers=num_layers, moe_layer_freq=(1, 0, 1))
        layer_ids = (0, 2)
    routes = PackedTensor.from_lengths(values, lengths)
    fill = [torch.iinfo(out).max - i for i in range(topk)] if edge_fill else "distinct"
    fill_row = np.arange(topk) if fill == "distinct" else np.asarray(fill)
    with pytest.MonkeyPatch.context() as patch:
        if small_grid is not None:
            patch.setattr(token_layout, "SMALL_GRID", small_grid)
        for layout in all_ranks(tp, cp, sp, False, **kwargs):
            want = expected(values, rank_rows(layout, lengths), layer_ids, fill_row)
            field = local_read(routes, layout, lengths) if local else routes
            got = expand(field, layout, fill=fill, dtype=out)
            for tensor, array in zip(got, want, strict=True):
                np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))
            batch = len(lengths)
            got = expand_batch_major(field, layout, fill=fill, dtype=out)
            for tensor, array in zip(got, want, strict=True):
                array = array.reshape(-1, batch, topk).transpose(1, 0, 2)
                np.testing.assert_array_equal(tensor.numpy(), array, err_msg=str(layout))
