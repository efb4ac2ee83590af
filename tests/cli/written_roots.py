"""Payload roots written with the real writer, and expert load counted the plain way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from r3data.payload import PayloadSegment, PayloadWriter
from r3data.synth import MODEL_SHAPES, SyntheticRouter, synth_rollouts

SHAPE = MODEL_SHAPES["glm-4.5-air"]


@dataclass
class WrittenRoot:
    root: Path
    routes: dict[str, np.ndarray]
    """Route rows per file (root-relative name)."""
    segments: list[PayloadSegment]


def bincount(routes: list[np.ndarray], experts: int) -> np.ndarray:
    """Assignments per expert over every MoE layer, counted the plain way."""
    moe = list(SHAPE.moe_layer_ids)
    return sum(np.bincount(r[:, moe].reshape(-1), minlength=experts) for r in routes)


def write_root(tmp_path: Path) -> WrittenRoot:
    """Three payload files, policy versions 0, 1 and 2, each with routes and a ragged mask."""
    root = tmp_path / "payloads"
    writer = PayloadWriter(root)
    rollouts = synth_rollouts(SyntheticRouter(SHAPE, seed=5), 3, seed=5, max_len=1024)
    routes, segments = {}, []
    for version, rollout in enumerate(rollouts):
        mask = [np.arange(i % 5, dtype=np.int32) for i in range(7)]
        written = writer.write(
            version,
            {"routed_experts": rollout.routes, "sampling_mask": mask},
            pos={"routed_experts": 0, "sampling_mask": 3},
        )
        routes[written[0].file] = rollout.routes
        segments += written
    return WrittenRoot(root, routes, segments)
