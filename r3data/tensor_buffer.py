"""Tensor <-> buffer helpers shared by packed containers: numpy intake, bit views, pickling.

Protocol-5 pickling hands a CPU tensor's bytes to pickle as a ``PickleBuffer`` so they can
travel out of band (zero copy); loading validates the byte count before building the tensor.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import torch

from r3data.errors import PackedError

# Same-width signed views for unsigned dtypes that torch only half supports (no index_copy_).
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def as_tensor(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A tensor sharing ``data``'s memory when torch can (read-only, reversed or big-endian
    arrays are copied)."""
    if isinstance(data, torch.Tensor):
        return data
    if not isinstance(data, np.ndarray):
        raise PackedError(f"expected a torch.Tensor or numpy.ndarray, found {type(data).__name__}")
    if data.dtype.kind not in "biuf" or data.dtype.itemsize > 8:  # no complex, no longdouble
        raise PackedError(f"expected a numeric or bool array torch holds, found dtype {data.dtype}")
    if (
        not data.flags.writeable
        or any(stride < 0 or stride % data.itemsize for stride in data.strides)
        or data.dtype.byteorder == ">"
    ):  # torch takes neither read-only memory, reversed or unaligned strides nor big-endian data
        data = np.array(data, dtype=data.dtype.newbyteorder("="))
    return torch.from_numpy(data)


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as a dtype that gather/scatter kernels support."""
    twin = _SIGNED_TWIN.get(tensor.dtype)
    return tensor if twin is None else tensor.view(twin)


def tensor_buffer(tensor: torch.Tensor, protocol: int) -> Any:
    """What to pickle for a tensor: its bytes, out of band (``PickleBuffer``) under protocol 5.

    Device tensors are left to torch's own pickling.
    """
    if tensor.device.type != "cpu":
        return tensor
    flat = tensor.detach().contiguous().reshape(-1)
    flat = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    data = pickle.PickleBuffer(flat) if protocol >= 5 else flat.tobytes()
    return (data, str(tensor.dtype), tuple(tensor.shape))


def rebuild_tensor(state: Any) -> torch.Tensor:
    """Inverse of :func:`tensor_buffer`, validating dtype and byte count."""
    if isinstance(state, torch.Tensor):
        return state
    buffer, dtype_name, shape = state
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PackedError(f"pickled tensor must name a torch dtype, found {dtype_name!r}")
    view = memoryview(buffer).cast("B")
    expected = math.prod(shape) * dtype.itemsize
    if view.nbytes != expected:
        raise PackedError(
            f"pickled tensor of shape {tuple(shape)} and dtype {dtype} needs {expected} bytes, "
            f"found {view.nbytes}"
        )
    if view.readonly:
        view = memoryview(bytearray(view))
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(tuple(shape))
