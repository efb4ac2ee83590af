"""r3data: the MoE router-replay data path from inference servers to trainers."""

from r3data.batch import TensorBatch
from r3data.errors import R3DataError
from r3data.packed import PackedTensor

__all__ = ["PackedTensor", "R3DataError", "TensorBatch"]
