"""Where routes go on a Megatron grid: padding, THD packing, CP zigzag, SP slices, PP layers.

Pure geometry over host integers and one gather on the routes' device: no files, no JSON, no
megatron import.
"""

from r3data.layout.gather import Fill, RoundRobin, expand, expand_batch_major, expand_mask
from r3data.layout.rows import RankRows
from r3data.layout.stages import ModelLayers
from r3data.layout.token_layout import LayerAxis, TokenLayout
from r3data.layout.token_runs import PAD, TokenRuns, TokenSegments

__all__ = [
    "PAD",
    "Fill",
    "LayerAxis",
    "ModelLayers",
    "RankRows",
    "RoundRobin",
    "TokenLayout",
    "TokenRuns",
    "TokenSegments",
    "expand",
    "expand_batch_major",
    "expand_mask",
]
