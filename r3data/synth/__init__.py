"""Synthetic rollouts of public MoE model shapes, served the way inference servers serve them.

For the demo, the notebooks, benchmarks and tests: realistic ragged multi-turn rollouts with
skewed expert load (:mod:`~r3data.synth.rollouts`), their responses in every producer's format
or as payload files (:mod:`~r3data.synth.serve`), and one RL step end to end
(:mod:`~r3data.synth.step`).
"""

from r3data.synth.models import MODEL_SHAPES, ModelShape, model_shape
from r3data.synth.rollouts import (
    LENGTH_DISTRIBUTIONS,
    Rollout,
    SyntheticRouter,
    draw_lengths,
    synth_rollouts,
)
from r3data.synth.serve import (
    INLINE_PRODUCERS,
    ServedRollouts,
    primerl_response,
    request_source,
    serve_rollouts,
    sglang_response,
    skyrl_response,
    vllm_response,
)
from r3data.synth.step import RankLoad, StepReport, play_step

__all__ = [
    "INLINE_PRODUCERS",
    "LENGTH_DISTRIBUTIONS",
    "MODEL_SHAPES",
    "ModelShape",
    "RankLoad",
    "Rollout",
    "ServedRollouts",
    "StepReport",
    "SyntheticRouter",
    "draw_lengths",
    "model_shape",
    "play_step",
    "primerl_response",
    "request_source",
    "serve_rollouts",
    "sglang_response",
    "skyrl_response",
    "synth_rollouts",
    "vllm_response",
]
