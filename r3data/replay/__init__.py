"""Hand rank-local routes to a trainer's routers.

- :mod:`r3data.replay.megatron` feeds megatron-core's ``RouterReplay`` (megatron is
  imported only when one of its functions runs);
- :mod:`r3data.replay.hf`: :func:`record` and :func:`replay` for Hugging Face transformers
  MoE models, with :func:`hf_inputs` laying a batch out for them;
- :mod:`r3data.replay.torchtitan`: the same for torchtitan's MoE router;
- :mod:`r3data.replay.agreement`: how often the trainer's own router agrees with the routes;
- :func:`replay_topk` serves any other top-k router.
"""

from r3data.replay.agreement import RoutingAgreement, compare_routes
from r3data.replay.hf import record, replay
from r3data.replay.hf_inputs import HFInputs, hf_inputs
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
from r3data.replay.routing import Record, Replay, Routers

__all__ = [
    "HFInputs",
    "Record",
    "Replay",
    "ReplayStep",
    "RoutingAgreement",
    "Routers",
    "check_config",
    "compare_routes",
    "hf_inputs",
    "install",
    "megatron_layout",
    "model_layers",
    "record",
    "replay",
    "replay_step",
    "replay_topk",
    "router_replays",
]
