"""Fuzzing load_packed_body and every producer format's decoder: random, mutated and lying
bodies only ever raise R3DataError subclasses, finish promptly, and allocate no more than a
plain parse plus a few times the body."""

from __future__ import annotations

import contextlib
import mmap
import tracemalloc

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from producer_bodies import nemorl_bodies, primerl_bodies, sglang_bodies, skyrl_bodies, vllm_bodies

from r3data.errors import R3DataError
from r3data.payload import PayloadSegment
from r3data.ragged import RaggedRows
from r3data.wire import ROUTE_DTYPES, load_packed_body, pack_csr, pack_ndarray
from r3data.wire.producers import FORMATS, EngineRequest, Lengths
from r3data.wire.producers.base import option_names

FIELDS = ("routed_experts", "sampling_mask")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.timeout(120)

TOKENS = [
    b"{", b"}", b"[", b"]", b'"', b":", b",", b" ", b"\\", b'\\"', b"null", b"1", b"-3",
    b"99999999999999999999", b'"routed_experts"', b'"sampling_mask"', b'"data"', b'"shape"',
    b'"dtype"', b'"uint8"', b'"int32"', b'"ids"', b'"counts"', b"QUJD", b"AAAA", b"==", b"[3]",
]  # fmt: skip


def _peak(call, expected: type[Exception]) -> int:
    """Peak traced memory of ``call``; only ``expected`` may escape it (anything else fails)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(expected):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _check(raw: bytes) -> None:
    """Only R3DataError may escape; memory stays within a plain parse plus twice the body."""
    baseline = _peak(lambda: orjson.loads(raw), orjson.JSONDecodeError)
    peak = _peak(lambda: load_packed_body(raw, FIELDS), R3DataError)
    assert peak <= baseline + 2 * len(raw) + 64 * 1024


@st.composite
def valid_bodies_and_choices(draw) -> tuple[bytes, list[tuple[str, object]]]:
    """A body of 1-3 choices, and per choice its kind and what it was built from."""
    choices, built = [], []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(0, 4))
        dtype = draw(st.sampled_from(ROUTE_DTYPES))
        routes = np.arange(rows * 6, dtype=dtype).reshape(rows, 3, 2)
        kind = draw(st.sampled_from(["envelope", "bare", "null", "mask"]))
        if kind == "envelope":
            choices.append({"routed_experts": pack_ndarray(routes, start=rows), "text": "hi"})
            built.append((kind, routes))
        elif kind == "bare":
            choices.append({"routed_experts": pack_ndarray(routes)["data"]})
            built.append((kind, routes))
        elif kind == "null":
            choices.append({"routed_experts": None})
            built.append((kind, None))
        else:
            counts = draw(st.lists(st.integers(0, 3), max_size=4))
            ids = np.arange(sum(counts), dtype=np.int32) * 7
            choices.append({"sampling_mask": pack_csr(ids, counts)})
            built.append((kind, (ids, np.array(counts, np.int32))))
    raw = orjson.dumps({"choices": choices, "note": '"routed_experts": "QUJD"'})
    return raw, built


valid_bodies = valid_bodies_and_choices().map(lambda pair: pair[0])


def _mutate(draw, body: bytes, tokens: list[bytes], min_edits: int) -> bytes:
    """``body`` after ``min_edits`` to 4 random edits: a span deleted or duplicated, one of
    ``tokens`` inserted, a byte replaced, the tail cut."""
    raw = bytearray(body)
    for _ in range(draw(st.integers(min_edits, 4))):
        at = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "duplicate", "truncate"]))
        span = draw(st.integers(1, 12))
        if op == "delete":
            del raw[at : at + span]
        elif op == "insert":
            raw[at:at] = draw(st.sampled_from(tokens))
        elif op == "replace" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif op == "duplicate":
            raw[at:at] = raw[at : at + span]
        else:
            del raw[at:]
    return bytes(raw)


@st.composite
def mutated_bodies(draw) -> bytes:
    return _mutate(draw, draw(valid_bodies), TOKENS, min_edits=1)


@st.composite
def lying_envelopes(draw) -> bytes:
    """Valid JSON whose envelopes claim shapes and dtypes their blobs do not hold."""
    shape = draw(st.lists(st.integers(-2, 2**62) | st.booleans() | st.floats(), max_size=5))
    dtype = draw(st.sampled_from(["uint8", "int64", "float64", "object", ">u2", "V8", "bool"]))
    data = draw(st.sampled_from(["", "AAAA", "QUJDRA==", "A" * 400]))
    envelope = {"data": data, "shape": shape, "dtype": dtype}
    return orjson.dumps({"choices": [{"routed_experts": envelope}]})


@pytest.mark.parametrize(
    "raw",
    [
        # empty arrays whose other extents overflow what numpy can shape (found by fuzzing)
        b'{"choices":[{"routed_experts":{"data":"","shape":[0,12709424,90713906831],'
        b'"dtype":"int64"}}]}',
        b'{"routed_experts":{"data":"","shape":[0,4611686018427387904,2],"dtype":"uint8"}}',
        # nesting deeper than orjson parses
        b'{"routed_experts":' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
)
def test_edge_bodies_raise_r3data_errors(raw):
    with pytest.raises(R3DataError):
        load_packed_body(raw, FIELDS)
    _check(raw)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(raw):
    _check(raw)


@SETTINGS
@given(st.lists(st.sampled_from(TOKENS), max_size=60).map(b"".join))
def test_token_soup(raw):
    _check(raw)


@SETTINGS
@given(mutated_bodies())
def test_mutated_bodies(raw):
    _check(raw)


@SETTINGS
@given(lying_envelopes())
def test_lying_envelopes(raw):
    _check(raw)


def _little_endian_bytes(array: np.ndarray) -> bytes:
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


@settings(max_examples=30, deadline=None)
@given(valid_bodies_and_choices())
def test_valid_bodies_always_decode(case):
    raw, built = case
    parsed = load_packed_body(raw, FIELDS)
    assert parsed["note"] == '"routed_experts": "QUJD"'
    assert len(parsed["choices"]) == len(built)
    for choice, (kind, source) in zip(parsed["choices"], built, strict=True):
        if kind == "envelope":
            assert choice.keys() == {"routed_experts", "text"}
            assert choice["text"] == "hi"
            envelope = choice["routed_experts"]
            assert envelope.keys() == {"data", "shape", "dtype", "start"}
            assert envelope["start"] == len(source)
            assert envelope["data"].dtype == source.dtype
            np.testing.assert_array_equal(envelope["data"], source)
            assert envelope["data"].tobytes() == _little_endian_bytes(source)
        elif kind == "bare":
            assert type(choice["routed_experts"]) is bytearray
            assert choice["routed_experts"] == _little_endian_bytes(source)
        elif kind == "null":
            assert choice == {"routed_experts": None}
        else:
            assert choice["sampling_mask"].keys() == {"ids", "counts"}
            for member, expected in zip(("ids", "counts"), source, strict=True):
                envelope = choice["sampling_mask"][member]
                assert envelope["dtype"] == "int32"
                assert envelope["shape"] == [len(expected)]
                assert envelope["data"].dtype == np.int32
                assert envelope["data"].tobytes() == _little_endian_bytes(expected)


# --- every producer format's decoder ---------------------------------------------------------


def _seed_bodies() -> list[tuple[str, bytes]]:
    """One small valid body per format and transport, as its producer builds it."""
    rng = np.random.default_rng(0)
    rows = np.argsort(rng.random((6, 3, 8)), axis=-1)[..., :2]
    prompt, completion = [1, 2, 3, 4], [5, 6, 7]
    mask = RaggedRows.from_rows([[3, 9], [], [4]])
    request = EngineRequest(prompt, completion, rows, num_experts=8, sampling_mask=mask)
    seeds = [(name, entry.encode(request)) for name, entry in FORMATS.items()]
    sample = vllm_bodies.Prompt(prompt, [vllm_bodies.Sample(completion, rows)])
    item = sglang_bodies.Item(prompt, completion, rows)
    kept = primerl_bodies.kept_tokens_field([np.array([3, 9], np.int32)], num_tokens=3)
    envelope = primerl_bodies.routed_experts_envelope(rows, version=1)
    handle, _ = primerl_bodies.payload_body(
        file="v1/a.bin",
        routes=rows.astype(np.uint8),
        routes_pos=0,
        mask=np.full((3, 2), -1),
        mask_pos=4,
        token_ids=completion,
    )
    support = skyrl_bodies.sample_support([[1, 2], [3], []], top_k=2)
    return [
        *seeds,
        ("vllm", vllm_bodies.tokens_stream(sample, num_experts=8, tokens_per_chunk=2)),
        ("vllm-0.21", vllm_bodies.chat_body_v021(sample, moe_layers=(1, 2))),
        ("sglang", sglang_bodies.generate_stream(item, tokens_per_chunk=2)),
        ("sglang", sglang_bodies.generate_body([item, item], batched=True)),
        ("sglang-openai", sglang_bodies.openai_stream(item)),
        ("prime-rl", primerl_bodies.generate_body(
            [{"token_ids": completion, "routed_experts": envelope, "kept_tokens": kept}],
            prompt_len=4,
            with_kept_tokens=True,
        )),
        ("prime-rl", handle),
        ("skyrl", skyrl_bodies.generate_body(completion, rows, support=support)),
        ("nemo-rl", nemorl_bodies.chat_body(
            nemorl_bodies.aligned_rows(rows[:4], 4, 3, num_experts=8), completion, legacy_lists=True
        )),
    ]  # fmt: skip


SEEDS = _seed_bodies()
FORMAT_TOKENS = [
    *TOKENS, b'"meta_info"', b'"sglext"', b'"kept_tokens"', b'"payload"', b'"start"',
    b'"prompt_routed_experts"', b'"rollout_sample_support"', b'"message"', b'"nrlre1:int8:9x9x9:',
    b"nrlre1:int32:99999999999x64x64:", b"data: ", b"\n\n", b"data: [DONE]", b'"token_ids"',
    b'"finish_reason":"length"', b"[[[1,2]]]", b'"k05VTVBZAQB2AHsn', b'"shape":[999999999999,3,2]',
]  # fmt: skip


def _decode_all(name: str, raw: bytes, lengths: Lengths) -> None:
    """Decode every choice of ``raw`` as format ``name``, every base64 row blob included."""
    entry = FORMATS[name]
    shaped = {"num_layers": 3, "topk": 2} if "num_layers" in option_names(entry.options) else {}
    for choice in entry.decode(raw, entry.make_options(shaped), lengths):
        for source in choice.sources:
            if not isinstance(source, PayloadSegment):
                assert source.array is not None


def _check_format(name: str, raw: bytes, lengths: Lengths) -> None:
    """Only R3DataError may escape; memory stays linear in the body (a plain parse, twice the
    body for the splice's copies and the decoded rows, once for a stream's events)."""
    baseline = _peak(lambda: orjson.loads(raw), orjson.JSONDecodeError)
    peak = _peak(lambda: _decode_all(name, raw, lengths), R3DataError)
    assert peak <= 2 * baseline + 3 * len(raw) + 64 * 1024


@st.composite
def mutated_format_bodies(draw) -> tuple[str, bytes]:
    name, seed = draw(st.sampled_from(SEEDS))
    return name, _mutate(draw, seed, FORMAT_TOKENS, min_edits=0)


@pytest.mark.parametrize(("name", "raw"), SEEDS)
def test_every_seed_body_decodes(name, raw):
    _check_format(name, raw, Lengths(4, 3))
    _decode_all(name, raw, Lengths(4, 3))


def _row_arrays(name: str, raw: object) -> list:
    """Every inline source of ``raw``'s choices: what the loader's fill decodes later."""
    entry = FORMATS[name]
    shaped = {"num_layers": 3, "topk": 2} if "num_layers" in option_names(entry.options) else {}
    choices = entry.decode(raw, entry.make_options(shaped), Lengths(4, 3))
    return [
        source
        for choice in choices
        for source in choice.sources
        if not isinstance(source, PayloadSegment)
    ]


def _swap_base64_letters(buffer: bytearray | mmap.mmap) -> None:
    """Rewrite the buffer in place as a reused receive buffer would be: every ``A`` becomes
    ``B`` and back, so each blob still decodes, to other values."""
    buffer[:] = bytes(buffer).translate(bytes.maketrans(b"AB", b"BA"))


INLINE_SEEDS = [(name, raw) for name, raw in SEEDS if _row_arrays(name, raw)]
"""The seed bodies with rows inline (the prime-rl handle body has only file segments)."""


@pytest.mark.parametrize(("name", "raw"), INLINE_SEEDS)
def test_a_reused_body_buffer_leaves_decoded_rows_as_they_arrived(name, raw, tmp_path):
    """A bytearray or mmap body rewritten after the decode (``readinto`` into the same buffer
    for the next response) must not change the rows the earlier sample's batch is filled with."""
    expected = [source.array for source in _row_arrays(name, raw)]
    received = bytearray(raw)
    sources = _row_arrays(name, received)
    _swap_base64_letters(received)
    _assert_arrays_equal([source.array for source in sources], expected)
    path = tmp_path / "body.json"
    path.write_bytes(raw)
    with path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
        sources = _row_arrays(name, mapped)
        _swap_base64_letters(mapped)
        got = [source.array for source in sources]
    _assert_arrays_equal(got, expected)  # and the mmap closed: nothing decoded points into it


def _assert_arrays_equal(got: list, expected: list) -> None:
    """Equal rows, dense arrays and ragged rows (values and offsets) alike."""
    assert len(got) == len(expected)
    for found, want in zip(got, expected, strict=True):
        assert type(found) is type(want)
        if isinstance(want, RaggedRows):
            np.testing.assert_array_equal(found.offsets, want.offsets)
            found, want = found.values, want.values
        np.testing.assert_array_equal(found, want)


@SETTINGS
@given(mutated_format_bodies(), st.sampled_from([Lengths(), Lengths(4, 3), Lengths(1, 9)]))
def test_mutated_producer_bodies(case, lengths):
    _check_format(*case, lengths)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        # claims far beyond their blobs: refused before anything sized by them is allocated
        ("nemo-rl", b'{"choices":[{"message":{"routed_experts":"nrlre1:int32:999999999999x64x64:AAAA"}}]}'),
        ("nemo-rl", b'{"choices":[{"message":{"routed_experts":"nrlre1:int8:0x0x0:"}}]}'),
        ("prime-rl", b'{"choices":[{"routed_experts":{"data":"AAAA","shape":[1099511627776,4,2]}}]}'),
        ("prime-rl", b'{"choices":[{"token_ids":[1],"kept_tokens":{"ids":"AAAA","counts":"////fw=="}}]}'),
        ("skyrl", b'{"choices":[{"token_ids":[1],"rollout_sample_support":{"data":"AAAA","shape":[1099511627776,2],"dtype":"int32"}}]}'),
        ("vllm", b'{"choices":[{"routed_experts":"k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDk5OTk5OTk5OTksIDQ4LCA4KSwgfSAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAo="}]}'),
        ("vllm-0.21", b'{"prompt_routed_experts":[[[1,2]],[[3]]],"choices":[{"routed_experts":null}]}'),
        ("vllm-0.21", b'{"prompt_routed_experts":[[[1.5,2]]],"choices":[{"routed_experts":[[["1",2]]]}]}'),
        ("skyrl-v1", b'{"choices":[{"routed_experts":[[[99999999999999999999999,2]]]}]}'),
        ("sglang", b'data: {"meta_info":{"routed_experts":"AAAAAAAAAAA="}}\n\ndata: {"meta_info":{}}\n\n'),
        ("sglang-openai", b'data: {"choices":[],"sglext":{"routed_experts":"AAAA"}}\n\ndata: {"choices":[],"sglext":{"routed_experts":"AAAA"}}\n\n'),
        ("vllm", b'data: {"choices":[{"index":0}]}\n\nnot an event\n\n'),
        ("vllm", b"data: [DONE]\n\ndata: {}\n\n"),
    ],
)  # fmt: skip
def test_hostile_producer_bodies_raise_r3data_errors(name, raw):
    with pytest.raises(R3DataError):
        _decode_all(name, raw, Lengths(4, 3))
    _check_format(name, raw, Lengths(4, 3))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_large_body_costs_a_small_multiple_of_itself(name):
    """Decoding 4000 rows (every blob included) allocates a few times the body, not more."""
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 128, (4000, 8, 4))
    mask = RaggedRows.from_rows([rng.integers(0, 9, i % 5) for i in range(2000)])
    request = EngineRequest(list(range(2001)), list(range(2000)), rows, sampling_mask=mask)
    raw = FORMATS[name].encode(request)
    _check_format(name, raw, Lengths(2001, 2000))
