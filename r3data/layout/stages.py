"""``ModelLayers``: which transformer layers exist, which are MoE, and which a pipeline stage builds.

The rules mirror megatron-core 0.16 (``get_num_layers_to_build``,
``get_transformer_layer_offset`` and ``get_gpt_decoder_layer_specs``):

- ``moe_layer_freq`` as an int ``N`` makes layer ``i`` an MoE layer iff ``i % N == 0``; as a
  sequence it is a 0/1 flag per layer (1 = MoE).
- Without ``stage_layers``, stages hold contiguous runs: ``num_layers / pp_size`` each, or, when
  ``first_stage_layers`` / ``last_stage_layers`` are set (Megatron's
  ``num_layers_in_first_pipeline_stage`` / ``..._last_...``), those counts on the first / last
  stage and the rest split evenly over the middle stages.
- ``stage_layers`` lists the global layer ids of every stage explicitly (Megatron's
  ``pipeline_model_parallel_layout``, or stages that account for embedding / loss); read in
  stage order they must be ``0 .. num_layers - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from r3data.errors import LayoutError
from r3data.validate import checked_int


@dataclass(frozen=True)
class ModelLayers:
    """The decoder layers of a model: how many, which are MoE, how pipeline stages split them."""

    num_layers: int
    moe_layer_freq: int | tuple[int, ...] = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    stage_layers: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        checked_int("num_layers", self.num_layers, minimum=1, error=LayoutError)
        freq = self.moe_layer_freq
        if isinstance(freq, Sequence) and not isinstance(freq, str):
            if len(freq) != self.num_layers or not all(
                isinstance(f, int | np.integer) and f in (0, 1) for f in freq
            ):  # a bool is a flag; 1.7 or "1" is not
                raise LayoutError(
                    f"moe_layer_freq as a pattern must hold {self.num_layers} flags of 0 or 1, "
                    f"found {list(freq)}"
                )
            object.__setattr__(self, "moe_layer_freq", tuple(int(f) for f in freq))
        else:
            checked_int("moe_layer_freq", freq, minimum=1, error=LayoutError)
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                checked_int(name, getattr(self, name), error=LayoutError)
        if self.stage_layers is not None:
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise LayoutError("give either stage_layers or first/last_stage_layers, found both")
            stages = self.stage_layers
            if not isinstance(stages, Sequence) or not all(
                isinstance(stage, Sequence) for stage in stages
            ):
                raise LayoutError(
                    f"stage_layers must be a sequence of stages of layer ids, found {stages!r:.80}"
                )
            flat = [i for stage in stages for i in stage]
            if not all(type(i) is int or isinstance(i, np.integer) for i in flat) or flat != list(
                range(self.num_layers)
            ):
                raise LayoutError(
                    f"stage_layers must split layers 0..{self.num_layers - 1} into consecutive "
                    f"runs, stage by stage, found {[list(s) for s in stages]}"
                )
            object.__setattr__(
                self, "stage_layers", tuple(tuple(int(i) for i in stage) for stage in stages)
            )

    @cached_property
    def is_moe(self) -> tuple[bool, ...]:
        """One flag per global layer: True where the layer has a router."""
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return tuple(bool(f) for f in freq)
        return tuple(i % freq == 0 for i in range(self.num_layers))

    @cached_property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the MoE layers, ascending."""
        return tuple(i for i, moe in enumerate(self.is_moe) if moe)

    def stage(self, pp_size: int, pp_rank: int) -> tuple[int, ...]:
        """Global ids of the layers pipeline stage ``pp_rank`` of ``pp_size`` builds, in order."""
        checked_int("pp_size", pp_size, minimum=1, error=LayoutError)
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
            raise LayoutError(f"pp_rank must be in [0, {pp_size}), found {pp_rank!r}")
        if self.stage_layers is not None:
            if len(self.stage_layers) != pp_size:
                raise LayoutError(
                    f"stage_layers lists {len(self.stage_layers)} stages, pp_size is {pp_size}"
                )
            return self.stage_layers[pp_rank]
        if pp_size == 1:
            return tuple(range(self.num_layers))
        counts = self._stage_counts(pp_size)
        start = sum(counts[:pp_rank])
        return tuple(range(start, start + counts[pp_rank]))

    def moe_stage(self, pp_size: int, pp_rank: int) -> tuple[int, ...]:
        """Global ids of the MoE layers stage ``pp_rank`` builds: one router each, in order."""
        is_moe = self.is_moe
        return tuple(i for i in self.stage(pp_size, pp_rank) if is_moe[i])

    def _stage_counts(self, pp_size: int) -> list[int]:
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = pp_size - (first is not None) - (last is not None)
        middle_layers = self.num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
            raise LayoutError(
                f"first/last stage layers ({first}, {last}) must add up to num_layers "
                f"{self.num_layers} over {pp_size} stages"
            )
        if middle_stages and middle_layers % middle_stages:
            raise LayoutError(
                f"{middle_layers} layers must split evenly over {middle_stages} pipeline stages"
            )
        per_stage = middle_layers // middle_stages if middle_stages else 0
        counts = [per_stage] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
