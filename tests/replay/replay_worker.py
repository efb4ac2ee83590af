"""One rank of the multi-process replay test (spawned by ``test_replay_distributed.py``).

Per grid, megatron's ``parallel_state`` is initialised over a real gloo group and each rank
builds real ``TopKRouter``s for the MoE layers its pipeline stage builds (from megatron's own
block spec). Per case:

1. "inference": each stage's routers RECORD top-k over the whole, unsharded batch (every
   token, every local layer); the PP group sums the records into ``[tokens, layers, topk]``
   with dense layers left zero, as vLLM reports them;
2. the routes travel as an r3data wire envelope through JSON, become a ``PackedTensor``,
   are laid out for this rank by ``expand`` and installed by ``replay_step``;
3. each router, fed fresh logits of this rank's tokens, REPLAYs forward and then recomputes;
   its routing map must equal the recorded routes of exactly this rank's tokens, found by an
   independent reference (megatron's ``get_batch_on_this_cp_rank`` for BSHD, Transformer
   Engine's THD partition rule written out here), and padding rows must hold top-k
   distinct experts.
"""

from __future__ import annotations

import numpy as np
import orjson
import torch
from megatron_helpers import EXPERTS, TOPK, build_routers, make_config, on_each_grid

GRIDS = {
    "tp2_cp2_sp": {"tp": 2, "cp": 2, "pp": 1, "sp": True, "layers": 3, "freq": 1, "first": None},
    "pp2_tp2_sp": {
        "tp": 2,
        "cp": 1,
        "pp": 2,
        "sp": True,
        "layers": 5,
        "freq": [1, 0, 1, 1, 1],
        "first": 3,
    },
    "cp4": {"tp": 1, "cp": 4, "pp": 1, "sp": False, "layers": 2, "freq": 1, "first": None},
}
CASES = [(packed, micro_batch) for packed in (True, False) for micro_batch in (1, 2)]


def run(rank: int, world: int, port: int) -> dict:
    return on_each_grid(rank, world, port, GRIDS, _grid)


def _grid(grid: dict) -> dict:
    from megatron.core import parallel_state

    config = make_config(
        num_layers=grid["layers"],
        moe_layer_freq=grid["freq"],
        tensor_model_parallel_size=grid["tp"],
        context_parallel_size=grid["cp"],
        pipeline_model_parallel_size=grid["pp"],
        pipeline_dtype=torch.float32 if grid["pp"] > 1 else None,
        num_layers_in_first_pipeline_stage=grid["first"],
        sequence_parallel=grid["sp"],
    )
    layer_ids = _local_moe_layers(config)
    routers = build_routers(config, [i + 1 for i in layer_ids])
    out = {
        "coords": {
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
        },
        "moe_layers": list(layer_ids),
        "bshd_cp_checks": _bshd_matches_megatron_cp(),
        "cases": [],
    }
    for case, (packed, micro_batch) in enumerate(CASES):
        out["cases"].append(_case(config, routers, layer_ids, packed, micro_batch, seed=case))
    return out


def _local_moe_layers(config) -> tuple[int, ...]:
    """Global ids of the MoE layers megatron builds on this stage, from its block spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    offset = get_transformer_layer_offset(config)
    return tuple(
        offset + j
        for j, layer in enumerate(spec.layer_specs)
        if layer.submodules.mlp.module is MoELayer
    )


def _record(config, routers, layer_ids, total: int, seed: int) -> torch.Tensor:
    """Whole-batch routes, every layer, recorded by megatron's routers (RECORD mode)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    routes = torch.zeros(total, config.num_layers, TOPK, dtype=torch.int64)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    for router, layer in zip(routers, layer_ids, strict=True):
        generator = torch.Generator().manual_seed(1000 * seed + layer)
        router.routing(torch.randn(total, 1, EXPERTS, generator=generator))
        routes[:, layer] = router.router_replay.get_recorded_indices()
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    torch.distributed.all_reduce(routes, group=parallel_state.get_pipeline_model_parallel_group())
    return routes


def _through_the_wire(routes: torch.Tensor, lengths: list[int]):
    from r3data.packed import PackedTensor
    from r3data.wire import pack_ndarray, unpack_ndarray

    body = orjson.dumps({"routed_experts": pack_ndarray(routes.numpy().astype(np.uint8))})
    array, _ = unpack_ndarray(orjson.loads(body)["routed_experts"])
    return PackedTensor.from_lengths(array, lengths)


def _reference_rows(packed: bool, lengths: list[int], tp: int, cp: int, sp: bool) -> list[int]:
    """This rank's tokens (packed-batch rows, -1 for padding) in router order."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    multiple = tp * (2 * cp if cp > 1 else 1)
    starts = np.cumsum([0, *lengths])
    if packed:  # Transformer Engine's THD partition: chunks r and 2cp-1-r of every sequence
        stream = []
        for start, n in zip(starts, lengths, strict=False):
            padded = -(-n // multiple) * multiple
            rows = [start + p if p < n else -1 for p in range(padded)]
            if cp > 1:
                chunk = padded // (2 * cp)
                rows = (
                    rows[cp_rank * chunk : (cp_rank + 1) * chunk]
                    + rows[(2 * cp - 1 - cp_rank) * chunk : (2 * cp - cp_rank) * chunk]
                )
            stream += rows
        columns = torch.tensor(stream).view(-1, 1)
    else:  # megatron's own CP slicing of a [batch, seq] tensor, then [seq, batch]
        seq = -(-max(lengths) // multiple) * multiple
        tokens = torch.full((len(lengths), seq), -1, dtype=torch.int64)
        for b, (start, n) in enumerate(zip(starts, lengths, strict=False)):
            tokens[b, :n] = torch.arange(start, start + n)
        columns = get_batch_on_this_cp_rank({"tokens": tokens})["tokens"].T
    if sp and tp > 1:  # sequence parallel: contiguous 1/TP slice of the sequence dimension
        part = columns.shape[0] // tp
        columns = columns[tp_rank * part : (tp_rank + 1) * part]
    return columns.reshape(-1).tolist()


def _case(config, routers, layer_ids, packed: bool, micro_batch: int, seed: int) -> dict:
    from r3data.replay import megatron_layout, replay_step

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=micro_batch).tolist()
    recorded = _record(config, routers, layer_ids, sum(lengths), seed)
    routes = _through_the_wire(recorded, lengths)

    layout = megatron_layout(config, packed=packed)
    from r3data.layout import expand

    per_layer = expand(routes, layout)
    rows = _reference_rows(
        packed, lengths, config.tensor_model_parallel_size, config.context_parallel_size,
        config.sequence_parallel,
    )  # fmt: skip
    batch = 1 if packed else micro_batch
    generator = torch.Generator().manual_seed(99 + seed)
    logits = torch.randn(len(rows) // batch, batch, EXPERTS, generator=generator)

    with replay_step(config) as step:
        with step.forward(per_layer):
            forward = [router.routing(logits)[1] for router in routers]
        recompute = [router.routing(logits)[1] for router in routers]

    real = torch.tensor([r >= 0 for r in rows], dtype=torch.bool)
    for mapping, again, layer in zip(forward, recompute, layer_ids, strict=True):
        assert torch.equal(mapping, again), f"layer {layer}: recompute differs from forward"
        expected = torch.zeros(len(rows), EXPERTS, dtype=torch.bool)
        expected[real] = expected[real].scatter(
            1, recorded[[r for r in rows if r >= 0], layer], True
        )
        assert torch.equal(mapping[real], expected[real]), f"layer {layer}: replay != record"
        assert torch.all(mapping[~real].sum(dim=1) == TOPK), f"layer {layer}: padding repeats"
    return {
        "packed": packed,
        "micro_batch": micro_batch,
        "lengths": lengths,
        "tokens": len(rows),
        "real_rows": [r for r in rows if r >= 0],
        "routers": len(routers),
    }


def _bshd_matches_megatron_cp() -> int:
    """``TokenLayout``'s BSHD CP split equals ``get_batch_on_this_cp_rank`` on the same tensor."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from r3data.layout import TokenLayout

    cp = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    checks = 0
    for seed in range(4):
        lengths = np.random.default_rng(seed).integers(0, 40, size=seed + 1).tolist()
        layout = TokenLayout(cp_size=cp, cp_rank=cp_rank, packed=False, padding_side="left")
        full = TokenLayout(
            cp_size=1, packed=False, pad_multiple=layout.multiple, padding_side="left"
        )
        padded = torch.from_numpy(np.ascontiguousarray(full.token_grid(lengths).T))  # [B, S]
        megatron = get_batch_on_this_cp_rank({"tokens": padded, "labels": padded + 1})
        ours = torch.from_numpy(np.ascontiguousarray(layout.token_grid(lengths).T))
        assert torch.equal(megatron["tokens"], ours), f"CP {cp} rank {cp_rank}, lengths {lengths}"
        assert torch.equal(megatron["labels"], ours + 1)
        checks += 1
    return checks
