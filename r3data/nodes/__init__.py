"""The torchdata.nodes pipeline: samples -> stitched traces -> packed ``TensorBatch``es."""

from r3data.nodes.collate import CollateRollouts
from r3data.nodes.dataset import RolloutDataset
from r3data.nodes.fill import FilledField, fill_field, materialize
from r3data.nodes.loader import loader
from r3data.nodes.sample import RolloutSample, as_rollout
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.source import SampleSource
from r3data.nodes.steps import BatchSteps
from r3data.nodes.stitcher import StitchedRollout, StitchRollout

__all__ = [
    "BatchSteps",
    "CollateRollouts",
    "FilledField",
    "RolloutDataset",
    "RolloutSample",
    "SampleSource",
    "ScreenOptions",
    "StitchRollout",
    "StitchedRollout",
    "as_rollout",
    "fill_field",
    "loader",
    "materialize",
]
