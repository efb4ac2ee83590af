"""expand / expand_batch_major / expand_mask against a per-token reference, on every rank."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import PAD, rank_rows

from r3data.errors import LayoutError
from r3data.layout import (
    ModelLayers,
    TokenLayout,
    TokenRuns,
    expand,
    expand_batch_major,
    expand_mask,
    gather,
)
from r3data.packed import PackedTensor

DTYPES = {torch.uint8: 256, torch.uint16: 65536, torch.int32: 2**31 - 1}


def random_routes(lengths, layers, topk, dtype, seed=0) -> PackedTensor:
    rng = np.random.default_rng(seed)
    high = DTYPES[dtype]
    values = rng.integers(high // 2, high, size=(sum(lengths), layers, topk))  # top half: sign bugs
    return PackedTensor.from_lengths(torch.from_numpy(values).to(dtype), lengths)


def rank_local(field: PackedTensor, layout: TokenLayout, lengths) -> PackedTensor:
    """What a rank-local read holds: each sample's ``local_ranges`` rows back to back."""
    ranges = layout.local_ranges(lengths)
    return PackedTensor.from_segments(
        [
            torch.cat([segment[lo:hi] for lo, hi in sample_ranges] or [segment[:0]])
            for segment, sample_ranges in zip(field, ranges, strict=True)
        ]
    )


def reference(routes: PackedTensor, rows: list[int], layer_ids, fill) -> list[np.ndarray]:
    values = routes.values.to(torch.int64).numpy()
    fill = np.asarray(fill)
    topk = routes.row_shape[1]
    return [
        np.array([values[r, layer] if r != PAD else fill for r in rows]).reshape(len(rows), topk)
        for layer in layer_ids
    ]


def all_ranks(tp, cp, sp, packed, side="right", **extra) -> list[TokenLayout]:
    return [
        TokenLayout(
            tp_size=tp,
            tp_rank=t,
            cp_size=cp,
            cp_rank=c,
            sequence_parallel=sp,
            packed=packed,
            padding_side="right" if packed else side,
            **extra,
        )
        for c in range(cp)
        for t in range(tp)
    ]


CASES = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2]),
        "cp": st.sampled_from([1, 2, 3]),
        "sp": st.booleans(),
        "packed": st.booleans(),
        "side": st.sampled_from(["left", "right"]),
        "lengths": st.lists(st.integers(0, 30), min_size=1, max_size=5),
        "layers": st.integers(1, 4),
        "topk": st.integers(1, 4),
        "dtype": st.sampled_from(list(DTYPES)),
        "out": st.sampled_from([torch.int32, torch.int64]),
    }
)


@settings(max_examples=50, deadline=None)
@given(case=CASES)
def test_expand_matches_the_reference_and_pads_with_distinct_experts(case):
    routes = random_routes(case["lengths"], case["layers"], case["topk"], case["dtype"])
    for layout in all_ranks(case["tp"], case["cp"], case["sp"], case["packed"], case["side"]):
        rows = rank_rows(layout, case["lengths"])
        got = expand(routes, layout, dtype=case["out"])
        want = reference(routes, rows, range(case["layers"]), np.arange(case["topk"]))
        assert len(got) == case["layers"]
        for tensor, expected in zip(got, want, strict=True):
            assert tensor.dtype == case["out"]
            assert tensor.shape == (len(rows), case["topk"])
            np.testing.assert_array_equal(tensor.numpy(), expected)
            pads = tensor[torch.tensor([r == PAD for r in rows], dtype=torch.bool)]
            assert all(len(set(row)) == case["topk"] for row in pads.tolist())


@settings(max_examples=40, deadline=None)
@given(case=CASES)
def test_expanding_local_rows_equals_expanding_the_full_batch(case):
    routes = random_routes(case["lengths"], case["layers"], case["topk"], case["dtype"])
    for layout in all_ranks(case["tp"], case["cp"], case["sp"], case["packed"], case["side"]):
        local = rank_local(routes, layout, case["lengths"])
        full = expand(routes, layout, dtype=torch.int64)
        from_local = expand(local, layout, dtype=torch.int64, local=True, lengths=case["lengths"])
        for a, b in zip(full, from_local, strict=True):
            assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(case=CASES)
def test_batch_major_form_holds_the_same_tokens(case):
    routes = random_routes(case["lengths"], case["layers"], case["topk"], case["dtype"])
    for layout in all_ranks(case["tp"], case["cp"], case["sp"], packed=False, side=case["side"]):
        rows = rank_rows(layout, case["lengths"])
        batch = len(case["lengths"])
        seq_major = np.asarray(rows).reshape(-1, batch)
        got = expand_batch_major(routes, layout, dtype=case["out"])
        for tensor, expected in zip(
            got,
            reference(routes, rows, range(case["layers"]), np.arange(case["topk"])),
            strict=True,
        ):
            assert tensor.shape == (batch, seq_major.shape[0], case["topk"])
            want = expected.reshape(seq_major.shape[0], batch, case["topk"]).transpose(1, 0, 2)
            np.testing.assert_array_equal(tensor.numpy(), want)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int32])
def test_long_runs_and_interleaved_dense_layers(packed, dtype):
    """Long samples take slice copies, here with dense layers to skip and pieces to split."""
    lengths = [700, 333, 1024, 5]
    model = ModelLayers(num_layers=6, moe_layer_freq=(1, 0, 1, 1, 0, 1))
    routes = random_routes(lengths, 6, 3, dtype, seed=3)
    for layout in all_ranks(2, 2, True, packed, layers=model, pp_size=2):
        for stage in range(2):
            staged = TokenLayout(**{**layout.__dict__, "pp_rank": stage})
            rows = rank_rows(staged, lengths)
            layer_ids = model.moe_stage(2, stage)
            for tensor, expected in zip(
                expand(routes, staged), reference(routes, rows, layer_ids, [0, 1, 2]), strict=True
            ):
                np.testing.assert_array_equal(tensor.numpy(), expected)


def test_moe_only_layer_axis_selects_the_same_routes():
    model = ModelLayers(num_layers=5, moe_layer_freq=(0, 1, 1, 0, 1))
    all_layers = random_routes([9, 4], 5, 2, torch.uint8)
    moe_only = PackedTensor(all_layers.values[:, [1, 2, 4]].contiguous(), all_layers.offsets)
    for pp_rank in range(1):
        layout = TokenLayout(layers=model, pp_rank=pp_rank)
        a = expand(all_layers, layout, layer_axis="all")
        b = expand(moe_only, layout, layer_axis="moe")
        assert len(a) == 3
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_custom_fill_and_output_dtype():
    routes = random_routes([3], 1, 3, torch.uint8)
    layout = TokenLayout(tp_size=4)
    (tensor,) = expand(routes, layout, fill=[7, 5, 6], dtype=torch.int64)
    assert tensor.dtype == torch.int64
    assert tensor[3].tolist() == [7, 5, 6]
    assert torch.equal(tensor[:3], routes.values[:, 0].to(torch.int64))


def test_an_empty_batch_and_a_stage_without_moe_layers():
    empty = PackedTensor.empty((2, 2), torch.uint8)
    assert [t.shape for t in expand(empty, TokenLayout())] == [(0, 2), (0, 2)]
    routes = random_routes([4], 2, 2, torch.uint8)
    no_moe = TokenLayout(
        layers=ModelLayers(num_layers=2, moe_layer_freq=(1, 0)), pp_size=2, pp_rank=1
    )
    assert expand(routes, no_moe) == []


def test_all_padding_when_the_rank_holds_no_real_tokens():
    routes = PackedTensor.from_lengths(torch.zeros((0, 1, 2), dtype=torch.uint8), [0, 0])
    (tensor,) = expand(routes, TokenLayout(packed=False, seq_length=4))
    assert tensor.tolist() == [[0, 1]] * 8


def test_expand_mask_follows_the_token_order():
    lengths = [5, 11, 3]
    rng = np.random.default_rng(1)
    mask = PackedTensor.from_lengths(torch.from_numpy(rng.random(sum(lengths)) > 0.5), lengths)
    for layout in all_ranks(2, 2, True, packed=True) + all_ranks(1, 2, False, packed=False):
        rows = rank_rows(layout, lengths)
        want = [bool(mask.values[r]) if r != PAD else False for r in rows]
        assert expand_mask(mask, layout).tolist() == want
        local = rank_local(mask, layout, lengths)
        assert expand_mask(local, layout, local=True, lengths=lengths).tolist() == want


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: expand(r.values, TokenLayout()), "must be a PackedTensor, found Tensor"),
        (
            lambda r: expand(r, TokenLayout(layers=ModelLayers(num_layers=4))),
            "routes hold 3 layers; layer_axis='all' of a model with 4 layers",
        ),
        (lambda r: expand(r, TokenLayout(), local=True), "local=True needs lengths"),
        (lambda r: expand(r, TokenLayout(), lengths=[2, 3]), "sample 0 must hold 2 rows, found 3"),
        (
            lambda r: expand(r, TokenLayout(), lengths=[3]),
            "lengths name 1 samples, the batch holds 2",
        ),
        (
            lambda r: expand(
                r, TokenLayout(tp_size=2, sequence_parallel=True), local=True, lengths=[3, 5]
            ),
            "sample 1 must hold 1 local rows, found 3",
        ),
        (lambda r: expand(r, TokenLayout(), fill="zeros"), "'distinct' or 2 distinct"),
        (lambda r: expand(r, TokenLayout(), fill=[1, 1]), "2 distinct expert ids >= 0, found"),
        (lambda r: expand(r, TokenLayout(), fill=[1.0, 2.0]), "2 integer expert ids"),
        (
            lambda r: expand(r, TokenLayout(), dtype=torch.float32),
            "torch.int32 or torch.int64 .*found torch.float32",
        ),
        (lambda r: expand_batch_major(r, TokenLayout()), "BSHD layout"),
        (lambda r: expand_mask(r, TokenLayout()), r"scalars, found row shape \(3, 2\)"),
        (lambda r: expand_mask(r.values, TokenLayout()), "mask must be a PackedTensor"),
    ],
)
def test_bad_arguments_raise(call, message):
    routes = random_routes([3, 3], 3, 2, torch.uint8)
    with pytest.raises(LayoutError, match=message):
        call(routes)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (torch.zeros((4, 2), dtype=torch.uint8), r"\[layers, topk\], found row shape \(2,\)"),
        (torch.zeros((4, 2, 0), dtype=torch.uint8), r"found row shape \(2, 0\)"),
        (torch.zeros((4, 2, 2), dtype=torch.float32), "integer expert ids, found dtype"),
    ],
)
def test_malformed_routes_raise(values, message):
    with pytest.raises(LayoutError, match=message):
        expand(PackedTensor.from_lengths(values, [4]), TokenLayout())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (torch.tensor([0.0, 0.5, 1.0]), r"bool or integer 0/1 values, found dtype torch.float32"),
        (torch.tensor([0, 2, 1], dtype=torch.uint8), r"0/1 values, found 2 at row 1"),
        (torch.tensor([1, 0, -1]), r"0/1 values, found -1 at row 2"),
    ],
)
def test_expand_mask_refuses_what_is_not_a_mask(values, message):
    with pytest.raises(LayoutError, match=message):
        expand_mask(PackedTensor.from_lengths(values, [3]), TokenLayout())


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64])
def test_expand_mask_takes_bool_and_integer_0_1_masks(dtype):
    mask = PackedTensor.from_lengths(torch.tensor([1, 0, 1, 1]).to(dtype), [1, 3])
    assert expand_mask(mask, TokenLayout()).tolist() == [True, False, True, True]


def test_expand_mask_on_a_rank_without_real_tokens():
    mask = PackedTensor.from_lengths(torch.ones(3, dtype=torch.bool), [3])
    layout = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True, pad_multiple=8)
    assert expand_mask(mask, layout).tolist() == [False] * 4


def test_lengths_may_be_a_tensor():
    routes = random_routes([4, 2], 1, 2, torch.uint8)
    layout = TokenLayout(cp_size=2, cp_rank=1)
    assert layout.local_ranges(torch.tensor([4, 2])) == layout.local_ranges([4, 2])
    local = rank_local(routes, layout, [4, 2])
    (a,) = expand(routes, layout)
    (b,) = expand(local, layout, local=True, lengths=torch.tensor([4, 2]))
    assert torch.equal(a, b)


@pytest.mark.parametrize("call", [expand, expand_batch_major])
@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float32, "int32"]
)
def test_outputs_are_int32_or_int64_only(call, dtype):
    """Narrower outputs wrapped expert ids: uint16 id 300 came out as 44 in uint8."""
    routes = PackedTensor.from_lengths(torch.full((2, 1, 2), 300, dtype=torch.uint16), [2])
    with pytest.raises(LayoutError, match=re.escape(f"found {dtype!r}")):
        call(routes, TokenLayout(packed=False), dtype=dtype)


@pytest.mark.parametrize("call", [expand, expand_batch_major])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_wide_ids_keep_their_values(call, dtype):
    values = torch.tensor([[[300, 65535]], [[65534, 299]]], dtype=torch.uint16)
    routes = PackedTensor.from_lengths(values, [2])
    (tensor,) = call(routes, TokenLayout(packed=False, seq_length=4), dtype=dtype)
    assert tensor.dtype == dtype
    assert tensor.reshape(-1, 2)[:2].tolist() == [[300, 65535], [65534, 299]]


@pytest.mark.parametrize("call", [expand, expand_batch_major])
@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_int64_ids_beyond_int32_need_an_int64_output(call, bad):
    values = torch.tensor([[[0, 1]], [[bad, 2]], [[3, 4]]], dtype=torch.int64)
    routes = PackedTensor.from_lengths(values, [3])
    layout = TokenLayout(packed=False)
    with pytest.raises(LayoutError, match=f"expert id {bad} at row 1, outside torch.int32"):
        call(routes, layout)
    (tensor,) = call(routes, layout, dtype=torch.int64)
    assert tensor.reshape(-1, 2).tolist() == values[:, 0].tolist()


def test_int64_ids_that_fit_int32_expand_to_int32():
    values = torch.tensor([[[2**31 - 1, 0]], [[-(2**31), 1]]], dtype=torch.int64)
    (tensor,) = expand(PackedTensor.from_lengths(values, [2]), TokenLayout())
    assert tensor.dtype == torch.int32
    assert tensor.tolist() == values[:, 0].tolist()


@pytest.mark.parametrize("call", [expand, expand_batch_major])
def test_fill_ids_must_fit_the_output_dtype(call):
    routes = random_routes([3], 1, 2, torch.uint8)
    layout = TokenLayout(packed=False, seq_length=4)
    with pytest.raises(
        LayoutError, match=re.escape("fill ids must fit torch.int32, found 2147483648")
    ):
        call(routes, layout, fill=[0, 2**31])
    (tensor,) = call(routes, layout, fill=[0, 2**31], dtype=torch.int64)
    assert tensor.reshape(-1, 2)[3].tolist() == [0, 2**31]
    with pytest.raises(LayoutError, match="2 integer expert ids"):
        call(routes, layout, fill=[0, 2**70], dtype=torch.int64)


@pytest.mark.parametrize("packed", [True, False])
def test_mixing_up_rank_local_and_full_rows_raises(packed):
    """Rank-local routes need local=True and the full lengths; each mix-up names the fix."""
    lengths = [40, 24, 7]
    layout = TokenLayout(
        tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=1, packed=packed
    )
    routes = random_routes(lengths, 2, 2, torch.uint8)
    local = rank_local(routes, layout, lengths)
    mask = PackedTensor.from_lengths(torch.ones(sum(lengths), dtype=torch.bool), lengths)
    local_mask = rank_local(mask, layout, lengths)
    calls = [expand] if packed else [expand, expand_batch_major]
    for call in calls:
        with pytest.raises(LayoutError, match="expand rank-local routes with local=True"):
            call(local, layout, lengths=lengths)
        with pytest.raises(LayoutError, match="lengths must be the full sample lengths"):
            call(local, layout, local=True, lengths=local.lengths)
        with pytest.raises(LayoutError, match="drop local=True"):
            call(routes, layout, local=True, lengths=lengths)
        full = call(routes, layout)
        assert all(
            torch.equal(a, b)
            for a, b in zip(full, call(local, layout, local=True, lengths=lengths), strict=True)
        )
    with pytest.raises(LayoutError, match="local=True, lengths="):
        expand_mask(local_mask, layout, lengths=lengths)


# --- the copy itself: host pieces and the accelerator's chunked gather agree ----------------

SEGMENTS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.integers(0, 60), st.integers(1, 70)),
        st.tuples(st.just("pad"), st.integers(1, 70)),
        st.tuples(st.just("rows"), st.lists(st.integers(0, 129), min_size=1, max_size=20)),
    ),
    min_size=1,
    max_size=8,
)


def token_index(segments) -> np.ndarray:
    """Runs of consecutive rows, runs of padding and scattered rows, one after another."""
    parts = []
    for segment in segments:
        if segment[0] == "run":
            parts.append(np.arange(segment[1], segment[1] + segment[2]))
        elif segment[0] == "pad":
            parts.append(np.full(segment[1], PAD))
        else:
            parts.append(np.asarray(segment[1]))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@settings(max_examples=80, deadline=None)
@given(
    segments=SEGMENTS,
    columns=st.integers(1, 3),
    batch_major=st.booleans(),
    layers=st.sampled_from([(0, 1, 2, 3), (1, 2), (3,), (0, 2, 3), (3, 1)]),
    dtype=st.sampled_from([torch.uint8, torch.uint16, torch.int64]),
    out_dtype=st.sampled_from([torch.int32, torch.int64]),
    strided=st.booleans(),
    sizes=st.sampled_from(
        [
            {"PIECE_BYTES": 1, "MIN_RUN_TOKENS": 1},
            {"PIECE_BYTES": 50, "MIN_RUN_TOKENS": 5},
            {"PIECE_BYTES": 50, "MIN_RUN_TOKENS": 5, "GATHER_CALLS": 0},
            {"MIN_RUN_TOKENS": 1000},
            {"MIN_RUN_TOKENS": 1000, "GATHER_CALLS": 1000},
            {},
        ]
    ),
)
def test_host_runs_and_device_chunks_copy_the_same_rows(
    segments, columns, batch_major, layers, dtype, out_dtype, strided, sizes
):
    """Every run kind and size, grid shape, layer selection and (strided) source, against a
    loop."""
    check_host_and_device_copies(
        segments, columns, batch_major, layers, dtype, out_dtype, strided, sizes, [7, 8, 9]
    )


@settings(max_examples=30, deadline=None)
@given(
    segments=SEGMENTS,
    columns=st.integers(2, 4),
    dtype=st.sampled_from([torch.uint8, torch.int8, torch.uint16]),
    sizes=st.sampled_from(
        [
            {"PIECE_BYTES": 1},
            {"PIECE_BYTES": 50, "MIN_RUN_TOKENS": 5},
            {"MIN_RUN_TOKENS": 1000, "GATHER_CALLS": 0},
            {},
        ]
    ),
)
def test_interleaved_columns_with_a_fill_the_routes_dtype_cannot_hold(
    segments, columns, dtype, sizes
):
    """Seq-major grids of several columns stage rows in the routes' dtype; a fill it cannot
    hold (300 in uint8) must still land whole."""
    check_host_and_device_copies(
        segments, columns, False, (0, 1, 2, 3), dtype, torch.int32, False, sizes, [300, 1, 2]
    )


def check_host_and_device_copies(
    segments, columns, batch_major, layers, dtype, out_dtype, strided, sizes, fill_row
):
    """Copy the grid the segments make, on the host and by the device path, against a loop."""
    rng = np.random.default_rng(len(segments))
    index = token_index(segments)
    index = np.concatenate((index, np.full(-index.size % columns, PAD)))
    grid = index.reshape(columns, -1).T  # [S, B]: each column a stretch of the segments
    seq = grid.shape[0]
    pieces = np.stack(
        [
            np.repeat(np.arange(columns), seq),
            np.tile(np.arange(seq), columns),
            grid.T.reshape(-1),
            np.ones(grid.size, dtype=np.int64),
        ]
    )
    runs = TokenRuns.from_pieces(seq, columns, pieces)
    assert np.array_equal(runs.grid(), grid)
    topk, rows = 3, 130
    high = min(200, torch.iinfo(dtype).max + 1)
    source = rng.integers(0, high, size=(rows, 5 if strided else 4, topk))
    values = torch.from_numpy(source).to(dtype)[:, :4]
    fill = torch.tensor(fill_row, dtype=out_dtype).expand(len(layers), topk)
    flat = grid.reshape(-1)
    want = np.stack(
        [source[r][list(layers)] if r != PAD else fill.numpy() for r in flat.tolist()]
    ).reshape(seq, columns, len(layers), topk)
    shape = (columns, seq) if batch_major else (seq, columns)
    host = torch.empty((*shape, len(layers), topk), dtype=out_dtype)
    places = host.numpy().swapaxes(0, 1) if batch_major else host.numpy()
    device = torch.empty((flat.size, len(layers), topk), dtype=out_dtype)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in sizes.items():
            patch.setattr(gather, name, value)
        tokens = runs if batch_major or columns == 1 else runs.segments()
        gather._copy_on_host(places, tokens, values.numpy(), layers, fill.contiguous().numpy())
        gather._copy_on_device(device, flat, values, layers, fill)
    np.testing.assert_array_equal(places, want)
    np.testing.assert_array_equal(device.numpy().reshape(want.shape), want)
