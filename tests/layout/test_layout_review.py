"""Adversarial review of the layout fast paths: expand against a per-token reference over
every geometry, staging blocks and segment edges at their boundaries, the BSHD piece cache,
repeated calls, and bad geometry (typed errors, never a wrap or a numpy error)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3data.errors import LayoutError
from r3data.layout import ModelLayers, TokenLayout, expand
from r3data.packed import PackedTensor

INT32_MAX = 2**31 - 1


def routes_of(lengths, layers=2, topk=2, dtype=torch.int32, seed=0) -> PackedTensor:
    rng = np.random.default_rng(seed)
    values = rng.integers(1, 100, size=(sum(lengths), layers, topk))
    return PackedTensor.from_lengths(torch.from_numpy(values).to(dtype), lengths)


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
