"""Replay one rank's routes through real Megatron routers on the CPU and check the routing
(the demo's and notebooks' proof; the multi-rank proof is the distributed test).

A single-process gloo group stands in for the rank (the routers only see its tokens); one
``TopKRouter`` per MoE layer is built with ``moe_enable_routing_replay``, the routes go in
through :func:`r3data.replay.replay_step`, and each router's routing map, in the forward and
again in activation recompute, must name exactly the installed experts. megatron-core is
imported only when the check runs (it is an optional extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from r3data.errors import ReplayError
from r3data.replay import replay_step
from r3data.replay.megatron import check_routes
from r3data.validate import checked_int

__all__ = ["ReplayOutcome", "check_replay"]

_NARROW_IDS = (torch.uint8, torch.int8, torch.int16, torch.int32)

ROUTER_HIDDEN = 64
"""Hidden size of the stand-in routers: replay never reads the gate weights' values."""


@dataclass(frozen=True)
class ReplayOutcome:
    """``verified``, ``skipped`` (nothing to replay with) or ``failed``, and why."""

    status: Literal["verified", "skipped", "failed"]
    detail: str


@contextlib.contextmanager
def _single_rank() -> Iterator[None]:
    """megatron's ``parallel_state`` on a one-process gloo group (only outside a trainer:
    :func:`check_replay` refuses to run where either already exists)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory(prefix="r3data-replay-") as tmp:
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def _routers(
    num_layers: int, num_experts: int, topk: int, count: int
) -> tuple[Any, torch.nn.ModuleList]:
    """A replay-enabled ``TransformerConfig`` and ``count`` CPU ``TopKRouter``s built with it."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=ROUTER_HIDDEN,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    return config, torch.nn.ModuleList(
        TopKRouter(config, pg_collection=groups) for _ in range(count)
    )


def _forget(routers: torch.nn.ModuleList) -> None:
    """Drop the routers' ``RouterReplay`` instances from megatron's process-wide list."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    ours = {id(router.router_replay) for router in routers}
    instances = RouterReplay.global_router_replay_instances
    instances[:] = [r for r in instances if id(r) not in ours]


def _replay(
    num_layers: int, routes: list[torch.Tensor], logits: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Routing maps of one router per layer in a replayed forward and in recompute."""
    num_experts, topk = logits.shape[-1], routes[0].shape[1]
    with _single_rank():
        config, routers = _routers(num_layers, num_experts, topk, len(routes))
        try:
            with replay_step(config, model=routers) as step:
                with step.forward(routes):
                    forward = [router.routing(logits)[1] for router in routers]
                with torch.enable_grad():  # as megatron's recompute in backward
                    recompute = [router.routing(logits)[1] for router in routers]
        finally:
            _forget(routers)
    return forward, recompute, len(routers)


def check_replay(
    per_layer: list[torch.Tensor], *, num_experts: int, num_layers: int | None = None, seed: int = 0
) -> ReplayOutcome:
    """Replay ``per_layer`` (one ``[tokens, topk]`` tensor per MoE layer, as
    :func:`r3data.layout.expand` gives them) through one Megatron router per layer of a
    model of ``num_layers`` decoder layers (default: one per tensor) and ``num_experts``."""
    if importlib.util.find_spec("megatron") is None:
        return ReplayOutcome(
            "skipped", "megatron-core is not installed (pip install 'r3data[megatron]')"
        )
    import torch.distributed as dist

    with warnings.catch_warnings():  # importing megatron warns that Transformer Engine is missing
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        return ReplayOutcome(
            "skipped",
            "a process group or Megatron model parallelism already exists: the check builds "
            "its own single-process routers and must not touch a trainer's state",
        )
    if not per_layer:
        return ReplayOutcome("skipped", "no MoE layer on this rank: nothing to replay")
    # narrow integer ids widen losslessly; anything else goes to the checks as it is
    routes = [
        t.to(torch.int64) if isinstance(t, torch.Tensor) and t.dtype in _NARROW_IDS else t
        for t in per_layer
    ]
    try:
        check_routes(routes, num_experts=num_experts)
        if num_layers is not None:
            checked_int("num_layers", num_layers, minimum=len(routes), error=ReplayError)
    except ReplayError as exc:
        return ReplayOutcome("failed", str(exc))
    tokens = routes[0].shape[0]
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, 1, num_experts, generator=generator)
    with warnings.catch_warnings():
        # megatron warns about missing Transformer Engine and the stand-in config's defaults
        warnings.simplefilter("ignore")
        try:
            forward, recompute, count = _replay(num_layers or len(routes), routes, logits)
        except ReplayError as exc:
            return ReplayOutcome("failed", str(exc))
    wrong = []
    for layer, want in enumerate(routes):
        expected = torch.zeros(tokens, num_experts, dtype=torch.bool)
        expected.scatter_(1, want, True)
        if not (torch.equal(forward[layer], expected) and torch.equal(recompute[layer], expected)):
            wrong.append(layer)
    if wrong:
        return ReplayOutcome(
            "failed", f"routing maps differ from the installed routes in layers {sorted(wrong)}"
        )
    return ReplayOutcome(
        "verified",
        f"{count} Megatron TopKRouters routed this rank's {tokens:,} tokens exactly "
        f"as installed, in the forward and in recompute",
    )
