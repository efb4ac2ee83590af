"""Hand rank-local routes to a trainer's routers.

:mod:`r3data.replay.megatron` feeds megatron-core's ``RouterReplay`` (megatron is imported
only when one of its functions runs); :func:`replay_topk` serves any other top-k router.
"""

from r3data.replay.megatron import (
    ReplayStep,
    check_config,
    install,
    megatron_layout,
    model_layers,
    replay_step,
    router_replays,
)
from r3data.replay.routes import replay_topk

__all__ = [
    "ReplayStep",
    "check_config",
    "install",
    "megatron_layout",
    "model_layers",
    "replay_step",
    "replay_topk",
    "router_replays",
]
