"""Routes and side channels on the wire: envelopes, one-pass body splicing, producer formats.

- :mod:`~r3data.wire.anchors`: where a request's route rows sit (the last token has none);
- :mod:`~r3data.wire.dtypes`: the dtypes allowed on the wire;
- :mod:`~r3data.wire.blob`: strict base64, decoded whole or straight into a buffer;
- :mod:`~r3data.wire.rows`: rows with positions, decoded (``InlineRows``) or not yet
  (``EncodedRows``);
- :mod:`~r3data.wire.envelope`: ``{"data": base64, "shape", "dtype", ...}`` packing;
- :mod:`~r3data.wire.npy`: the ``.npy`` header of vLLM's routes, read strictly;
- :mod:`~r3data.wire.splice`: parsing a JSON body without turning its blobs into strings;
- :mod:`~r3data.wire.producers`: the producer registry, one module per response format
  version (vLLM, SGLang, prime-rl, SkyRL, NeMo-RL);
- :mod:`~r3data.wire.masks`: CSR sampling masks and per-token floats.
"""

from r3data.wire.anchors import anchored_pos, end_anchored_pos, routes_end, start_anchored_pos
from r3data.wire.blob import decode_base64
from r3data.wire.dtypes import ALL_DTYPES, ROUTE_DTYPES, parse_dtype
from r3data.wire.envelope import compact_routes, pack_ndarray, unpack_ndarray
from r3data.wire.masks import (
    MASK_FILL,
    NEG_INF_SENTINEL,
    check_csr,
    csr_to_padded,
    floats_from_json,
    floats_to_json,
    pack_csr,
    padded_to_csr,
    unpack_csr,
)
from r3data.wire.producers import (
    primerl_routes,
    primerl_sampling_mask,
    read_npy,
    sglang_routes,
    skyrl_routes,
    vllm_routes,
)
from r3data.wire.rows import EncodedRows, InlineRows, RowSource
from r3data.wire.splice import load_packed_body

__all__ = [
    "ALL_DTYPES",
    "MASK_FILL",
    "NEG_INF_SENTINEL",
    "ROUTE_DTYPES",
    "EncodedRows",
    "InlineRows",
    "RowSource",
    "anchored_pos",
    "check_csr",
    "compact_routes",
    "csr_to_padded",
    "decode_base64",
    "end_anchored_pos",
    "floats_from_json",
    "floats_to_json",
    "load_packed_body",
    "pack_csr",
    "pack_ndarray",
    "padded_to_csr",
    "parse_dtype",
    "primerl_routes",
    "primerl_sampling_mask",
    "read_npy",
    "routes_end",
    "sglang_routes",
    "skyrl_routes",
    "start_anchored_pos",
    "unpack_csr",
    "unpack_ndarray",
    "vllm_routes",
]
