"""The torchdata.nodes pipeline: samples -> stitched traces -> packed ``TensorBatch``es, one
micro-batch of one optimizer step on one rank at a time."""

from r3data.nodes.batch_loader import BatchLoader
from r3data.nodes.collate import CollateRollouts
from r3data.nodes.dataset import RolloutDataset
from r3data.nodes.fill import FilledField, fill_field, materialize
from r3data.nodes.loader import loader
from r3data.nodes.options import CollateOptions, TraceOptions
from r3data.nodes.sample import RolloutSample, as_rollout
from r3data.nodes.screen import ScreenOptions
from r3data.nodes.source import MicroBatch, StepSource
from r3data.nodes.steps import DataParallel, MicroBatches, Shuffle, plan_step
from r3data.nodes.stitcher import StitchedRollout, StitchRollout

__all__ = [
    "BatchLoader",
    "CollateOptions",
    "CollateRollouts",
    "DataParallel",
    "FilledField",
    "MicroBatch",
    "MicroBatches",
    "RolloutDataset",
    "RolloutSample",
    "ScreenOptions",
    "Shuffle",
    "StepSource",
    "StitchRollout",
    "StitchedRollout",
    "TraceOptions",
    "as_rollout",
    "fill_field",
    "loader",
    "materialize",
    "plan_step",
]
