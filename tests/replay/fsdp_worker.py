"""One rank of the FSDP2 replay test (spawned by ``test_hf_fsdp.py``), over a gloo group.

Per case (a model family and an FSDP2 configuration), every rank:

1. builds the same tiny random model (the "engine"), which records the routes of a global
   batch, unsharded; the routes travel as inline rows through ``r3data.loader`` with
   ``DataParallel(rank, 2)``, so each rank gets its own share of the samples;
2. shards a copy ("the trainer") with ``fully_shard`` per decoder layer (in one case also
   per MoE block and per router; in another on an HSDP mesh) and the whole model, as FSDP
   trainers do, and replays its share in a forward and a backward (with activation
   checkpointing where the family has it): the experts used must be the recorded ones, the
   agreement 1.0 in fp32, the outputs those of the unsharded engine replaying the same
   routes, the gradients its gradients averaged over the ranks;
3. drifts the trainer's sharded router weights: its own routing now differs, the replay
   still routes as recorded, and the score threshold replaces some slots;
4. gets every way to call it wrong, each a ``ReplayError``, and replays fine afterwards.

The facts come back as a report per case; ``test_hf_fsdp.py`` checks them.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

GLOBAL_LENGTHS = (5, 9, 3, 7, 4, 6)
WORLD = 2
TITAN = Path(__file__).resolve().parents[2] / ".cache" / "torchtitan"

#: name -> family, fully_shard's reshard_after_forward, what is sharded (decoder layers, or
#: routers and MoE blocks too), bf16 mixed precision.
CASES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"family": "qwen3_moe", "reshard": True, "shard": "layers", "bf16": False},
    "qwen3_moe_bf16": {"family": "qwen3_moe", "reshard": False, "shard": "layers", "bf16": True},
    "deepseek_v3": {"family": "deepseek_v3", "reshard": False, "shard": "routers", "bf16": False},
    "dbrx": {"family": "dbrx", "reshard": True, "shard": "layers", "bf16": False},
    "llama4": {"family": "llama4", "reshard": False, "shard": "layers", "bf16": False},
    "gpt_oss": {"family": "gpt_oss", "reshard": True, "shard": "layers", "bf16": False},
    "torchtitan": {"family": "torchtitan", "reshard": True, "shard": "layers", "bf16": False},
    # HSDP: replicated over the two ranks, sharded over one (DTensors all the same)
    "qwen2_moe_hsdp": {"family": "qwen2_moe", "reshard": True, "shard": "layers", "bf16": False},
}
#: Cases on a 2-D (replicate, shard) device mesh instead of the default 1-D one.
MESHES = {"qwen2_moe_hsdp": (WORLD, 1)}


def run(rank: int, world: int, port: int) -> dict[str, dict]:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # transformers' and torchtitan's deprecations
    try:
        return {name: _case(rank, name, spec) for name, spec in CASES.items()}
    finally:
        torch.distributed.destroy_process_group()


# --- the models -------------------------------------------------------------------------------


class _Family:
    """How the test builds, calls and shards one family (transformers' or torchtitan's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.titan = name == "torchtitan"
        if self.titan:
            import test_torchtitan_moe_layer as titan

            from r3data.replay import torchtitan as replays

            self.build = lambda: titan.Decoder()
            self.replays = replays
            self.find_routers = replays.find_routers
        else:
            from hf_helpers import tiny_model

            from r3data.replay import hf as replays
            from r3data.replay.hf_routers import find_routers

            self.build = lambda: tiny_model(name)[0]
            self.replays = replays
            self.find_routers = find_routers

    def forward(self, model: torch.nn.Module, inputs, **overrides) -> torch.Tensor:
        if self.titan:
            return model(overrides.get("input_ids", inputs["input_ids"]))
        return model(**{**inputs, **overrides}).logits

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        if self.titan:
            return model.layers
        return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))

    def checkpointing(self, model: torch.nn.Module) -> bool:
        """Turn activation checkpointing on where the family has it."""
        if self.titan:
            model.checkpointing = True
            return True
        if not getattr(model, "supports_gradient_checkpointing", False):
            return False
        model.activation_checkpointing_enable()
        return True

    def router_weights(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The weight making each router's logits."""
        if self.titan:
            return [block.moe.router.gate.weight for block in model.layers]
        from hf_helpers import routers_of

        return [next(p for p in r.parameters() if p.dim() == 2) for r in routers_of(model)]


def _shard(family: _Family, model: torch.nn.Module, name: str, spec: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"reshard_after_forward": spec["reshard"]}
    if name in MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", MESHES[name], mesh_dim_names=("dp", "fsdp"))
    if spec["bf16"]:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if spec["shard"] == "routers":  # the router and its MoE block as FSDP modules of their own
        from hf_helpers import routers_of

        for router in routers_of(model):
            fully_shard(router, **options)
        for layer in family.layers(model):
            if hasattr(layer.mlp, "experts"):
                fully_shard(layer.mlp, **options)
    for layer in family.layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)


# --- one case ---------------------------------------------------------------------------------


def _case(rank: int, name: str, spec: dict) -> dict:
    started = time.perf_counter()
    if spec["family"] == "torchtitan":
        if TITAN.is_dir() and str(TITAN) not in sys.path:
            sys.path.append(str(TITAN))
        if importlib.util.find_spec("torchtitan") is None:
            return {
                "unavailable": f"torchtitan is not installed (make titan-env puts it in {TITAN})"
            }
    from r3data.replay import hf_inputs

    family = _Family(spec["family"])
    engine = family.build()
    batch, recorded, indices = _rank_batch(family, engine, rank)
    inputs = hf_inputs(batch)
    report: dict[str, Any] = {"indices": indices, "tokens": int(batch["token_ids"].lengths.sum())}
    report["loader_routes_exact"] = torch.equal(batch["routed_experts"].values, recorded.values)

    trainer = copy.deepcopy(engine)
    _shard(family, trainer, name, spec)
    trainer.train()
    checkpointed = family.checkpointing(trainer)
    report["checkpointed"] = checkpointed
    report["sharded"] = all(type(w).__name__ == "DTensor" for w in family.router_weights(trainer))
    mask = inputs.token_mask().reshape(inputs.input_ids.shape)

    with family.replays.replay(trainer, batch, inputs) as session:
        with family.replays.record(trainer, inputs) as used:
            out = family.forward(trainer, inputs)
        out[mask].float().sum().backward()
    report["probed"] = [site.probed for site in session.routers.sites]
    report["contract"] = _contracts(session.routers)
    report["unsharded_contract"] = _contracts(family.find_routers(engine))
    report["replayed_exact"] = torch.equal(used.routes.values, recorded.values)
    report["agreement"] = session.agreement.mean_exact
    report["batch_agreement"] = batch.metadata["agreement"].mean_exact
    report["forwards"] = list(session.session.forwards.values())
    report["recomputes"] = list(session.session.recomputes.values())
    report["out_dtype"] = str(out.dtype)
    router_grads = [w.grad.full_tensor() for w in family.router_weights(trainer)]
    report["router_grads_nonzero"] = all(bool(g.abs().sum() > 0) for g in router_grads)
    if not spec["bf16"]:
        report.update(_against_unsharded(family, engine, trainer, batch, inputs, out, mask))

    report.update(_drifted(family, trainer, batch, inputs, recorded))
    report["errors"] = _errors(family, trainer, batch, inputs, recorded)
    with (
        family.replays.replay(trainer, batch, inputs),
        family.replays.record(trainer, inputs) as again,
    ):
        family.forward(trainer, inputs)[mask].float().sum().backward()
    report["replays_after_errors"] = torch.equal(again.routes.values, recorded.values)
    report["seconds"] = time.perf_counter() - started
    return report


def _contracts(routers) -> list[list]:
    """What the probe learnt of each router: the method holding the top-k, how the output
    carries the pick, whether it selects on raw logits."""
    return [[site.method, site.carries, site.selects_on_logits] for site in routers.sites]


def _rank_batch(family: _Family, engine: torch.nn.Module, rank: int):
    """This rank's share of a global batch whose routes the unsharded engine recorded,
    through ``r3data.loader``; with the routes recorded for its samples and their indices."""
    from hf_helpers import samples, token_batch

    import r3data
    from r3data import PackedTensor
    from r3data.nodes import DataParallel
    from r3data.replay import hf_inputs

    everything = token_batch(GLOBAL_LENGTHS, seed=7)
    full = hf_inputs(everything)
    with torch.no_grad(), family.replays.record(engine, full) as engine_routes:
        family.forward(engine, full)
    routes = engine_routes.routes
    (batch,) = list(
        r3data.loader(
            samples(everything, routes, "inline"),
            batch_size=len(GLOBAL_LENGTHS),
            data_parallel=DataParallel(rank=rank, size=WORLD),
            trace={"last_token_row": True},
            collate={"workers": 1},
            prefetch=0,
        )
    )
    indices = list(batch.metadata["index"])
    recorded = PackedTensor.from_segments([routes[i] for i in indices])
    return batch, recorded, indices


def _against_unsharded(family, engine, trainer, batch, inputs, out, mask) -> dict:
    """The unsharded engine replaying the same routes on the same inputs: its outputs, and
    its gradients averaged over the ranks (as FSDP reduces them)."""
    reference = copy.deepcopy(engine).train()
    with family.replays.replay(reference, batch, inputs):
        expected = family.forward(reference, inputs)
        expected[mask].float().sum().backward()
    worst = 0.0
    for mine, theirs in zip(trainer.parameters(), reference.parameters(), strict=True):
        if theirs.grad is None:
            continue
        averaged = theirs.grad.clone()
        torch.distributed.all_reduce(averaged)
        averaged /= WORLD
        full = mine.grad.full_tensor()
        scale = float(averaged.abs().max()) or 1.0
        worst = max(worst, float((full - averaged).abs().max()) / scale)
    return {
        "outputs_max_diff": float((out[mask] - expected[mask]).abs().max()),
        "grads_max_rel_diff": worst,
    }


def _drifted(family, trainer, batch, inputs, recorded) -> dict:
    """Drift the sharded router weights (as updates would), then route with and without replay."""
    from torch.distributed.tensor import distribute_tensor

    from r3data.replay import compare_routes

    generator = torch.Generator().manual_seed(11)  # the same drift on every rank
    with torch.no_grad():
        for weight in family.router_weights(trainer):
            noise = torch.randn(weight.shape, generator=generator)
            weight.add_(distribute_tensor(noise, weight.device_mesh, weight.placements))
        with family.replays.record(trainer, inputs) as own:
            family.forward(trainer, inputs)
        with (
            family.replays.replay(trainer, batch, inputs) as session,
            family.replays.record(trainer, inputs) as used,
        ):
            family.forward(trainer, inputs)
        with family.replays.replay(trainer, batch, inputs, threshold=1.0) as strict:
            family.forward(trainer, inputs)
    return {
        "drifted_own_exact": compare_routes(own.routes, recorded).mean_exact,
        "drifted_agreement": session.agreement.mean_exact,
        "drifted_replayed_exact": torch.equal(used.routes.values, recorded.values),
        "drifted_replace_rate": strict.agreement.replace_rate,
    }


def _errors(family, trainer, batch, inputs, recorded) -> dict[str, list]:
    """Each wrong call: the exception's type, message, and whether the model ran first."""
    from hf_helpers import EXPERTS, VOCAB

    from r3data import PackedTensor

    ran = []
    hook = trainer.register_forward_pre_hook(lambda *_: ran.append(1))
    found: dict[str, list] = {}

    def attempt(name: str, routes, call=None) -> None:
        ran.clear()
        try:
            with torch.no_grad(), family.replays.replay(trainer, routes, inputs):
                family.forward(trainer, inputs, **(call or {}))
            found[name] = ["nothing raised", "", bool(ran)]
        except Exception as error:  # reported, the test names the expected type
            found[name] = [type(error).__name__, str(error), bool(ran)]

    big = recorded.values.clone()
    big[0, -1, 0] = EXPERTS
    attempt("expert_id_out_of_range", PackedTensor(big, recorded.cu_seqlens))
    top1 = PackedTensor(recorded.values[:, :, :1].contiguous(), recorded.cu_seqlens)
    attempt("other_topk", top1)
    other = inputs.input_ids.clone()
    other[0, 0] = (other[0, 0] + 1) % VOCAB
    attempt("other_input_ids", batch, {"input_ids": other})
    if not family.titan:  # hidden states of another token count reach the routers
        shape = (*inputs.input_ids.shape[:-1], inputs.input_ids.shape[-1] + 2)
        embeds = torch.randn(*shape, trainer.config.hidden_size)
        call = {"input_ids": None, "inputs_embeds": embeds, "attention_mask": None}
        attempt("other_token_count", batch, call | {"position_ids": None})
    hook.remove()
    return found
