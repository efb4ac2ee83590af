"""Feed expanded routes to megatron-core's ``RouterReplay`` (imported lazily: an optional extra).

What megatron-core 0.16.1 does (read from its source, and exercised by this package's tests):

- ``TopKRouter.__init__`` appends one ``RouterReplay`` to the class-level list
  ``RouterReplay.global_router_replay_instances`` when ``config.moe_enable_routing_replay``,
  so the list holds every router this process built, in construction order (this pipeline
  stage's MoE layers; also the MTP block's and any second model's). Nothing removes them but
  ``RouterReplay.clear_global_router_replay_instances()``.
- ``RouterReplay.set_replay_data(per_layer)`` requires one tensor per instance and calls
  ``set_target_indices``, which sets ``target_topk_idx`` and *appends* to
  ``replay_backward_list``.
- ``TopKRouter.routing`` passes its ``RouterReplay`` to ``topk_routing_with_score_function``,
  whose top-k step asks ``get_replay_topk``: RECORD keeps the computed indices;
  REPLAY_FORWARD uses ``target_topk_idx`` (every call, it is not consumed); REPLAY_BACKWARD
  pops ``replay_backward_list[0]`` (a FIFO for activation recompute); no action computes
  top-k normally. Replayed probabilities are ``scores.gather(1, indices)``, so gates stay
  differentiable, and the routing map is a scatter of the indices: a row with a repeated
  expert routes the token to fewer than top-k experts, and fewer index rows than tokens
  leave the rest unrouted without an error.
- a CUDA graph (``cuda_graph_impl``) whose scope holds the router replays captured kernels:
  the Python ``get_replay_topk`` runs only in warm-up and capture: later installs go unread.
- ``moe_router_fusion=True`` calls Transformer Engine's fused top-k and never consults
  ``RouterReplay``; ``moe_router_load_balancing_type="sinkhorn"`` skips it too;
  ``moe_router_force_load_balancing`` replaces the logits by random ones, so replayed gates
  would be random.
- ``moe_expert_capacity_factor`` drops assignments over an expert's capacity after replay
  (``apply_router_token_dropping``); ``overlap_moe_expert_parallel_comm`` (``combined_1f1b``)
  runs a micro-batch's layers after ``forward_step_func`` returns, interleaved with another
  micro-batch's backward.
- megatron-core never sets an action itself: the trainer switches to REPLAY_BACKWARD after a
  forward so that recomputation during backward pops the forward's indices in order.

:func:`replay_step` packages that protocol and checks it was followed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from r3data.errors import ReplayError
from r3data.layout import ModelLayers, TokenLayout
from r3data.validate import checked_int

__all__ = [
    "ReplayStep",
    "check_config",
    "check_routes",
    "install",
    "megatron_layout",
    "model_layers",
    "replay_step",
    "router_replays",
]

_INDEX_DTYPES = (torch.int32, torch.int64)
_SCOPES_WITHOUT_ROUTER = {"attn", "mlp", "mamba"}
"""``CudaGraphScope`` names whose graphs hold no router (an empty scope is the whole layer)."""


def _router_replay() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError as error:
        raise ReplayError(
            "r3data.replay.megatron needs megatron-core >= 0.16: pip install 'r3data[megatron]'"
        ) from error
    return router_replay


def check_config(config: Any) -> None:
    """Refuse a ``TransformerConfig`` under which Megatron would not (faithfully) replay."""
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ReplayError(
            "config.moe_enable_routing_replay must be True: without it no router builds a "
            "RouterReplay"
        )
    if getattr(config, "moe_router_fusion", False):
        raise ReplayError(
            "config.moe_router_fusion must be False: the fused top-k router ignores RouterReplay "
            "and would route by its own logits"
        )
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise ReplayError(
            "moe_router_load_balancing_type 'sinkhorn' never consults RouterReplay; use 'aux_loss', "
            "'seq_aux_loss', 'global_aux_loss' or 'none'"
        )
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vpp not in (None, 1):
        raise ReplayError(
            f"virtual pipeline parallelism is not supported, found "
            f"virtual_pipeline_model_parallel_size={vpp}: installing routes for every local "
            "router at each forward would feed other model chunks' FIFOs"
        )
    impl = getattr(config, "cuda_graph_impl", "none")
    scopes = [getattr(s, "name", s) for s in getattr(config, "cuda_graph_scope", None) or []]
    if impl != "none" and (not scopes or set(scopes) - _SCOPES_WITHOUT_ROUTER):
        raise ReplayError(
            "a CUDA graph that captures the router replays its captured kernels and never asks "
            "RouterReplay: expected cuda_graph_impl='none' or a cuda_graph_scope within "
            f"{sorted(_SCOPES_WITHOUT_ROUTER)}, found cuda_graph_impl={impl!r}, "
            f"cuda_graph_scope={scopes or 'the whole layer'}"
        )
    if getattr(config, "moe_router_force_load_balancing", False):
        raise ReplayError(
            "config.moe_router_force_load_balancing must be False: it replaces the logits the "
            "replayed gates are gathered from by random ones"
        )
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None and capacity * config.moe_router_topk < config.num_moe_experts:
        experts, topk = config.num_moe_experts, config.moe_router_topk
        raise ReplayError(
            f"config.moe_expert_capacity_factor={capacity} can drop replayed routes: the router "
            "drops assignments over an expert's capacity after replay (padding rows take "
            "capacity too), so tokens would miss experts the engine routed them to; expected "
            f"None or a factor of at least num_moe_experts / moe_router_topk = {experts / topk:g}"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ReplayError(
            "config.overlap_moe_expert_parallel_comm must be False: its schedule runs a "
            "micro-batch's layers after forward_step_func has returned, interleaved with another "
            "micro-batch's backward, so no step.forward holds one micro-batch's routes around them"
        )


def model_layers(config: Any, *, hybrid_override_pattern: str | None = None) -> ModelLayers:
    """The decoder layers of a megatron model: MoE pattern and every pipeline stage's layers.

    Stages come from megatron-core's own ``get_transformer_layer_offset`` and
    ``get_num_layers_to_build`` (or the custom ``pipeline_model_parallel_layout``), so uneven
    stages and stages accounting for embedding or loss match what the model builds.

    A hybrid model (``MambaModel``, ``config.is_hybrid_model``) builds the layers of its
    ``hybrid_override_pattern``, which its config does not hold: pass it. Its MoE layers are
    the pattern's ``E``s and its stages are ``MambaStack``'s (``num_layers / PP`` each, or the
    uneven first and last stages; embedding, loss and custom layouts play no part).
    """
    if hybrid_override_pattern is not None or getattr(config, "is_hybrid_model", False):
        return _hybrid_layers(config, hybrid_override_pattern)
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp_size = config.pipeline_model_parallel_size
    vp_stage = 0 if config.virtual_pipeline_model_parallel_size is not None else None
    stages = []
    for pp_rank in range(pp_size):
        custom = config.pipeline_model_parallel_layout
        if custom is not None:
            ids = custom.get_layer_id_list(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        else:
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            ids = range(offset, offset + count)
        stages.append(tuple(ids))
    freq = config.moe_layer_freq
    return ModelLayers(
        num_layers=config.num_layers,
        moe_layer_freq=tuple(freq) if isinstance(freq, Sequence) else freq,
        stage_layers=tuple(stages),
    )


def _hybrid_layers(config: Any, pattern: str | None) -> ModelLayers:
    """:func:`model_layers` of a hybrid model: the layer kinds from megatron's own
    ``allocate_layers``, the stages as ``MambaStack._select_layers_for_pipeline_parallel``
    cuts them (which :class:`ModelLayers`' first/last stages mirror)."""
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers

    if not isinstance(pattern, str):
        raise ReplayError(
            "config.is_hybrid_model: expected the model's hybrid_override_pattern (a hybrid "
            "model's MoE layers are its 'E's, which its config does not hold), found "
            f"{pattern!r}"
        )
    try:
        kinds = allocate_layers(config.num_layers, 0.0, 0.0, pattern)
    except ValueError as error:
        raise ReplayError(f"hybrid_override_pattern {pattern!r}: {error}") from error
    return ModelLayers(
        num_layers=config.num_layers,
        moe_layer_freq=tuple(int(kind == Symbols.MOE) for kind in kinds),
        first_stage_layers=config.num_layers_in_first_pipeline_stage,
        last_stage_layers=config.num_layers_in_last_pipeline_stage,
    )


def megatron_layout(
    config: Any,
    *,
    packed: bool,
    padding_side: str = "right",
    pad_multiple: int | None = None,
    seq_length: int | None = None,
    hybrid_override_pattern: str | None = None,
) -> TokenLayout:
    """This rank's :class:`TokenLayout`, from ``parallel_state`` and a ``TransformerConfig``
    (whose parallel sizes must be the state's: the model was built by one of them; hybrid
    context parallelism, whose CP groups change per sub-sample, is refused). A hybrid model
    passes its ``hybrid_override_pattern`` (see :func:`model_layers`)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ReplayError(
            "megatron_layout reads this rank's place from parallel_state: expected its groups "
            "(initialize_model_parallel), found none"
        )
    sizes = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
    }
    if getattr(config, "hybrid_context_parallel", False):
        raise ReplayError(
            "config.hybrid_context_parallel must be False (megatron's scheduler then gives each "
            "sub-sample a context-parallel group of its own size, which no static layout "
            f"follows), found {config.hybrid_context_parallel!r}"
        )
    for name, size in sizes.items():
        if getattr(config, name, size) != size:
            raise ReplayError(
                f"config.{name} must be parallel_state's {size} (the model's layout), found "
                f"{getattr(config, name)!r}"
            )
    return TokenLayout(
        tp_size=sizes["tensor_model_parallel_size"],
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        sequence_parallel=bool(config.sequence_parallel),
        cp_size=sizes["context_parallel_size"],
        cp_rank=parallel_state.get_context_parallel_rank(),
        pp_size=sizes["pipeline_model_parallel_size"],
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        vpp_size=config.virtual_pipeline_model_parallel_size,
        packed=packed,
        padding_side=padding_side,  # type: ignore[arg-type]
        pad_multiple=pad_multiple,
        seq_length=seq_length,
        layers=model_layers(config, hybrid_override_pattern=hybrid_override_pattern),
    )


def router_replays(model: torch.nn.Module | Sequence[torch.nn.Module] | None = None) -> list[Any]:
    """The ``RouterReplay`` instances to feed, in layer order.

    ``None``: megatron's global list (every router this process built). A module (or the
    list of model chunks megatron returns): the routers inside it, in module order, for a
    process that holds more than one model.
    """
    replay_cls = _router_replay().RouterReplay
    if model is None:
        return list(replay_cls.global_router_replay_instances)
    chunks = [model] if isinstance(model, torch.nn.Module) else model
    if isinstance(chunks, str | bytes) or not (
        isinstance(chunks, Sequence) and all(isinstance(c, torch.nn.Module) for c in chunks)
    ):
        raise ReplayError(
            "model: expected a torch.nn.Module or a sequence of them (megatron's model chunks), "
            f"found {type(model).__name__}"
        )
    return [
        module.router_replay
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(getattr(module, "router_replay", None), replay_cls)
    ]


def _check_per_layer(routes: Any) -> None:
    """Routes come as one tensor per layer: a stacked tensor would iterate by token."""
    if not isinstance(routes, Sequence):
        raise ReplayError(
            "routes_per_layer: expected a sequence of per-layer tensors, found "
            f"{type(routes).__name__}"
        )


def check_routes(
    routes: Sequence[torch.Tensor], *, num_experts: int, topk: int | None = None
) -> None:
    """The checks :func:`install` makes on the tensors themselves, without routers: each a
    ``[tokens, topk]`` int32/int64 tensor, all of one shape and device, ids in
    ``[0, num_experts)``, distinct experts per row."""
    _check_per_layer(routes)
    checked_int("num_experts", num_experts, minimum=1, error=ReplayError)
    first = None
    for layer, tensor in enumerate(routes):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            found = (
                tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise ReplayError(f"routes[{layer}] must be a [tokens, topk] tensor, found {found}")
        if tensor.dtype not in _INDEX_DTYPES:
            raise ReplayError(
                f"routes[{layer}] must be int32 or int64 (torch.gather indices), found {tensor.dtype}"
            )
        if topk is not None and tensor.shape[1] != topk:
            raise ReplayError(f"routes[{layer}] must hold top-{topk} rows, found {tensor.shape[1]}")
        if tensor.shape[1] == 0:
            raise ReplayError(f"routes[{layer}] must hold at least one expert per row, found 0")
        first = tensor if first is None else first
        if tensor.shape[1] != first.shape[1]:  # megatron routes every column it is given
            raise ReplayError(
                f"routes[{layer}] must hold top-{first.shape[1]} rows like routes[0], found "
                f"{tensor.shape[1]}"
            )
        if tensor.shape[0] != first.shape[0]:
            raise ReplayError(
                f"routes[{layer}] must hold {first.shape[0]} tokens like routes[0], found "
                f"{tensor.shape[0]}"
            )
        if tensor.device != first.device:
            raise ReplayError(
                f"routes[{layer}] must be on {first.device} like routes[0], found {tensor.device}"
            )
    if first is None or not first.shape[0]:
        return
    stats = torch.stack(
        [torch.stack([t.min().long(), t.max().long(), _has_repeat(t).long()]) for t in routes]
    ).tolist()  # one synchronisation for every layer
    for layer, (low, high, repeated) in enumerate(stats):
        if low < 0 or high >= num_experts:
            raise ReplayError(
                f"routes[{layer}] expert ids must be in [0, {num_experts}), found "
                f"{low if low < 0 else high}"
            )
        if repeated:
            raise ReplayError(
                f"routes[{layer}] has a row that repeats an expert: the dispatcher expects "
                "top-k distinct experts per token (padding must be filled with distinct ids)"
            )


def _has_repeat(tensor: torch.Tensor) -> torch.Tensor:
    ordered = tensor.sort(dim=1).values
    return (ordered[:, 1:] == ordered[:, :-1]).any()


def install(
    routes_per_layer: Sequence[torch.Tensor],
    *,
    num_experts: int,
    topk: int | None = None,
    model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
) -> None:
    """Validate one micro-batch's per-layer routes and hand them to the local routers.

    Checks one tensor per router, then :func:`check_routes` (one ``[tokens, topk]`` shape and
    device, int32/int64, ids in ``[0, num_experts)``, distinct experts per row), then does what
    ``RouterReplay.set_replay_data`` does (target indices set, backward FIFO appended).
    """
    _check_per_layer(routes_per_layer)
    instances = router_replays(model)
    if len(routes_per_layer) != len(instances):
        raise ReplayError(
            f"expected one routes tensor per local router ({len(instances)} RouterReplay "
            f"instances: this stage's MoE layers, plus any MTP or second model's), found "
            f"{len(routes_per_layer)}"
        )
    check_routes(routes_per_layer, num_experts=num_experts, topk=topk)
    if model is None:
        _router_replay().RouterReplay.set_replay_data(list(routes_per_layer))
    else:
        for instance, tensor in zip(instances, routes_per_layer, strict=True):
            instance.set_target_indices(tensor)


@dataclass
class _Tally:
    """What one router did during a step."""

    installs: int = 0
    forwards: int = 0
    recomputes: int = 0
    unreplayed: int = 0


class ReplayStep:
    """One training step's replay: install per micro-batch, replay, check consumption."""

    def __init__(self, config: Any, instances: list[Any], model: Any) -> None:
        self._config = config
        self._instances = instances
        self._model = model
        self._tallies = [_Tally() for _ in instances]
        self._action = _router_replay().RouterReplayAction

    @contextmanager
    def forward(self, routes_per_layer: Sequence[torch.Tensor]) -> Iterator[None]:
        """Install one micro-batch's routes and replay them in the forward run inside.

        On exit the routers switch to REPLAY_BACKWARD, so activation recomputation during
        backward pops this micro-batch's routes from the FIFO, in forward order.
        """
        install(
            routes_per_layer,
            num_experts=self._config.num_moe_experts,
            topk=self._config.moe_router_topk,
            model=self._model,
        )
        for tally in self._tallies:
            tally.installs += 1
        self._set_action(self._action.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._set_action(self._action.REPLAY_BACKWARD)

    def _set_action(self, action: Any) -> None:
        for instance in self._instances:
            instance.set_router_replay_action(action)

    def _instrument(self) -> None:
        """Count each router's replays and check every replayed tensor fits its tokens."""
        action, num_experts = self._action, self._config.num_moe_experts
        for layer, (instance, tally) in enumerate(zip(self._instances, self._tallies, strict=True)):
            original = instance.get_replay_topk

            def get_replay_topk(
                scores, topk, *args, _original=original, _instance=instance, _tally=tally,
                _layer=layer, **kwargs,
            ):  # fmt: skip
                mode = _instance.router_replay_action
                if mode == action.REPLAY_FORWARD:
                    _tally.forwards += 1
                    target = _instance.target_topk_idx
                elif mode == action.REPLAY_BACKWARD:
                    _tally.recomputes += 1
                    if not torch.is_grad_enabled():  # recompute builds the graph for backward
                        raise ReplayError(
                            f"router {_layer}: a forward without grad outside step.forward "
                            "would replay the backward FIFO; expected a recompute (grad "
                            "enabled), found grad disabled"
                        )
                    if not _instance.replay_backward_list:
                        raise ReplayError(
                            f"router {_layer}: recompute #{_tally.recomputes} found no routes "
                            f"left in its backward FIFO ({_tally.installs} installed this step)"
                        )
                    target = _instance.replay_backward_list[0]
                else:
                    _tally.unreplayed += 1
                    target = None
                if target is not None and scores.shape[1] != num_experts:
                    raise ReplayError(
                        f"router {_layer} scores {scores.shape[1]} experts, the routes were "
                        f"checked against num_experts={num_experts}: config and model disagree"
                    )
                if target is not None and tuple(target.shape) != (scores.shape[0], topk):
                    raise ReplayError(
                        f"router {_layer} routes {scores.shape[0]} tokens with top-{topk}, the "
                        f"installed routes are {list(target.shape)}: layout and batch disagree"
                    )
                return _original(scores, topk, *args, **kwargs)

            instance.get_replay_topk = get_replay_topk

    def _restore(self) -> None:
        for instance in self._instances:
            instance.__dict__.pop("get_replay_topk", None)
            instance.clear_indices()
            instance.clear_router_replay_action()

    def _check_consumed(self) -> None:
        for layer, (instance, tally) in enumerate(zip(self._instances, self._tallies, strict=True)):
            if tally.forwards != tally.installs:
                raise ReplayError(
                    f"router {layer}: {tally.installs} micro-batches installed but "
                    f"{tally.forwards} replayed forwards; every installed batch must be "
                    "replayed exactly once"
                )
            if tally.recomputes not in (0, tally.installs):
                raise ReplayError(
                    f"router {layer}: recomputed {tally.recomputes} of {tally.installs} "
                    "micro-batches; its backward FIFO is out of step"
                )
            left, expected = len(instance.replay_backward_list), tally.installs - tally.recomputes
            if left != expected:
                raise ReplayError(
                    f"router {layer}: expected its backward FIFO to hold {expected} entries "
                    f"({tally.installs} installed, {tally.recomputes} recomputed), found {left}: "
                    "routes were installed or taken outside step.forward"
                )
            if tally.unreplayed:
                raise ReplayError(
                    f"router {layer}: routed {tally.unreplayed} times without replay inside "
                    "replay_step (a forward outside step.forward?)"
                )


@contextmanager
def replay_step(
    config: Any, *, model: torch.nn.Module | Sequence[torch.nn.Module] | None = None
) -> Iterator[ReplayStep]:
    """Replay routes for one training step; check and clear every router on the way out.

    Inside, wrap each micro-batch's forward in ``step.forward(routes_per_layer)``. On a clean
    exit each router must have replayed every installed micro-batch exactly once forward and
    either never or exactly once in recompute; on any exit indices, FIFOs and actions are
    cleared, so an aborted step leaves nothing stale for the next one.
    """
    check_config(config)
    instances = router_replays(model)
    busy = [i for i, r in enumerate(instances) if "get_replay_topk" in vars(r)]
    if busy:  # its exit would strip the other step's counting and clear its routes
        raise ReplayError(
            f"routers {busy} are in another replay step: expected one step at a time, found "
            "replay_step entered again inside it"
        )
    stale = [i for i, r in enumerate(instances) if r.replay_backward_list or r.router_replay_action]
    if stale:
        raise ReplayError(
            f"routers {stale} hold routes or an action from outside a replay step; "
            "clear them with RouterReplay.clear_global_indices() and "
            "clear_global_router_replay_action()"
        )
    step = ReplayStep(config, instances, model)
    step._instrument()
    try:
        yield step
        step._check_consumed()
    finally:
        step._restore()
