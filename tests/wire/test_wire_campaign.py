"""The wire's attack campaign, bounded and seeded: mutated bodies against a reference parser,
and the header, count and key lies the campaigns found (each refused with a WireFormatError,
never a raw exception, a wrong decode or a wrapped-around count)."""

from __future__ import annotations

import io
import struct

import numpy as np
import orjson
import pybase64
import pytest

from r3data.errors import R3DataError, WireFormatError
from r3data.nodes.screen import ScreenOptions
from r3data.wire import check_csr, load_packed_body, pack_ndarray, read_npy, unpack_csr
from r3data.wire.envelope import ENVELOPE_KEYS

FIELDS = ("routed_experts", "sampling_mask")
MUTATIONS = 3000
ALPHABET = list(b'{}[]":, \\/=+AQxn0123456789-eE.tfu')


def _body(rng: np.random.Generator) -> bytes:
    choices = []
    for _ in range(int(rng.integers(1, 4))):
        rows = rng.integers(0, 9, (int(rng.integers(0, 4)), 3, 2)).astype(np.uint8)
        if rng.random() < 0.5:
            choices.append({"routed_experts": pack_ndarray(rows, start=int(rng.integers(0, 5)))})
        else:
            choices.append({"routed_experts": pack_ndarray(rows)["data"], "index": 1})
    return orjson.dumps({"choices": choices, "usage": {"prompt_tokens": 3}})


def _reference(raw: bytes) -> object:
    """What a body means by JSON's own rules: orjson, then the value of every registered key
    (not inside another one's value) decoded strictly: a bare blob, an envelope or a group."""
    parsed = orjson.loads(raw)
    stack = [parsed]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(node, dict) and key in FIELDS:
                node[key] = _decoded(value)
            elif isinstance(value, dict | list):
                stack.append(value)
    return parsed


def _decoded(value: object) -> object:
    if isinstance(value, str):
        return pybase64.b64decode(value, validate=True)
    if isinstance(value, dict) and "data" in value:
        data = pybase64.b64decode(value["data"], validate=True)
        return {
            **value,
            "data": np.frombuffer(data, np.dtype(value["dtype"])).reshape(value["shape"]),
        }
    if isinstance(value, dict):
        return {k: _decoded(v) if isinstance(v, dict) else v for k, v in value.items()}
    return value


def _same(ours: object, reference: object) -> bool:
    if isinstance(reference, dict):
        return (
            isinstance(ours, dict)
            and ours.keys() == reference.keys()
            and all(_same(ours[k], reference[k]) for k in reference)
        )
    if isinstance(reference, list):
        return (
            isinstance(ours, list)
            and len(ours) == len(reference)
            and all(_same(a, b) for a, b in zip(ours, reference, strict=True))
        )
    if isinstance(reference, np.ndarray):
        return isinstance(ours, np.ndarray) and np.array_equal(ours, reference)
    if isinstance(reference, bytes):
        return bytes(ours) == reference
    return ours == reference


def test_mutated_bodies_decode_as_the_reference_or_are_refused():
    """Thousands of seeded byte mutations of valid bodies: whenever r3data decodes one, the
    result is the reference's (a JSON parse plus strict base64); otherwise it raises an
    R3DataError. Never another exception, never a different answer."""
    rng = np.random.default_rng(2026)
    agreed = refused = 0
    for _ in range(MUTATIONS):
        raw = bytearray(_body(rng))
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(raw)))
            kind = rng.random()
            if kind < 0.5:
                raw[at] = int(rng.choice(ALPHABET))
            elif kind < 0.75:
                del raw[at]
            else:
                raw.insert(at, int(rng.choice(ALPHABET)))
        raw = bytes(raw)
        try:
            ours = load_packed_body(raw, FIELDS)
        except R3DataError:
            refused += 1
            continue
        try:
            reference = _reference(raw)
        except Exception:
            reference = None
        # what r3data decodes, the reference decodes the same way (r3data may be stricter:
        # it refuses escapes inside blobs, which JSON would accept)
        assert reference is not None, raw
        assert _same(ours, reference), raw
        agreed += 1
    assert agreed > 100  # the campaign reached both outcomes
    assert refused > 100


def _npy(shape_text: bytes, descr: bytes = b"'|u1'") -> bytes:
    header = b"{'descr': " + descr + b", 'fortran_order': False, 'shape': " + shape_text + b", }"
    header = header + b" " * (118 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(64)


@pytest.mark.parametrize(
    "shape",
    [b"(-1, -1, 4)", b"(True, 2, 2)", b"(2, 2.5, 2)", b"(2, 2)", b"(2,, 2)", b"('a', 1, 1)",
     b"(99999999999999999999999, 1, 1)", b"(2, 2, 2, 2)", b"(4, 2, 0)"],
)  # fmt: skip
def test_every_npy_header_lie_is_a_wire_format_error(shape):
    with pytest.raises(WireFormatError):
        read_npy(_npy(shape))


def test_npy_headers_numpy_writes_are_read():
    rows = np.arange(24, dtype=np.uint16).reshape(4, 3, 2)
    buffer = io.BytesIO()
    np.save(buffer, rows)
    np.testing.assert_array_equal(read_npy(buffer.getvalue()), rows)


@pytest.mark.parametrize("dtype", ["uint64", "int64", "uint32"])
def test_csr_counts_that_do_not_fit_int32_are_refused_not_wrapped(dtype):
    huge = np.array([2**64 - 1 if dtype == "uint64" else 2**31], dtype=dtype)
    with pytest.raises(WireFormatError, match="expected sizes <= 2147483647"):
        check_csr(np.zeros(0, np.int32), huge)
    mask = {"ids": pack_ndarray(np.zeros(0, np.int32)), "counts": pack_ndarray(huge)}
    with pytest.raises(WireFormatError):  # and an envelope of them is refused by its dtype
        unpack_csr(mask)


def test_a_registered_key_under_an_escaped_one_is_decoded_where_it_stands():
    """``routed\\u005fexperts`` is the same key to JSON but not to the byte scan: its value is
    left as parsed, and a registered key inside it is decoded like any other."""
    raw = b'{"routed\\u005fexperts": {"x": {"routed_experts": "QUJD"}}}'
    parsed = load_packed_body(raw)
    assert bytes(parsed["routed_experts"]["x"]["routed_experts"]) == b"ABC"
    escaped_envelope = b'{"routed\\u005fexperts": {"data": "QUJD", "shape": [3], "dtype": "uint8"}}'
    assert load_packed_body(escaped_envelope)["routed_experts"]["data"] == "QUJD"  # as parsed
    assert set(ENVELOPE_KEYS) == {"data", "shape", "dtype"}


def test_negative_sglang_ids_never_reach_a_batch_as_expert_ids():
    """SGLang's int32 ids: a row holding a negative id is missing (screened), with or without
    num_experts."""
    from r3data import loader

    ids = np.full((4, 2, 2), 3, np.int32)
    ids[1, 0, 1] = -7
    response = {"meta_info": {"routed_experts": ids.tobytes(), "routed_experts_start_len": 0}}
    source = {"producer": "sglang", "response": response, "num_layers": 2, "topk": 2}
    sample = {
        "id": "neg",
        "token_ids": np.arange(5),
        "requests": [{"prompt_len": 2, "completion_len": 3, "sources": [source]}],
    }
    for num_experts in (None, 8):
        (batch,) = loader([sample], batch_size=1, collate={"workers": 1}, num_experts=num_experts)
        routes = batch["routed_experts"][0].numpy()
        assert (routes >= 0).all()
        assert not batch["routed_experts_valid"][0].any()  # a gap: never replayed
        assert batch.metadata["stats"].rows_missing == 1
    assert ScreenOptions().zero_rows == "missing"
