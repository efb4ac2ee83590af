"""Decoders that turn each inference server's response into rows with positions.

One function per producer, each accepting the raw body (spliced, blobs left encoded) or an
already parsed object, so a trainer can take routes from any of them.
"""

from r3data.wire.producers.primerl import primerl_routes, primerl_sampling_mask
from r3data.wire.producers.sglang import sglang_routes
from r3data.wire.producers.skyrl import skyrl_routes
from r3data.wire.producers.vllm import read_npy, vllm_routes

__all__ = [
    "primerl_routes",
    "primerl_sampling_mask",
    "read_npy",
    "sglang_routes",
    "skyrl_routes",
    "vllm_routes",
]
