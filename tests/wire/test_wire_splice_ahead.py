"""load_packed_body decoding a blob on the way to its closing quote (``_Scanner._ahead``).

The reference is the plain path (find the quote, then decode), which ``_memchr`` returning
None forces: every body must give the same values, and every bad one the same error, type and
text, whichever chunk the decoder stops in and whether the previous blob was larger, smaller
or the same size.
"""

from __future__ import annotations

import base64
import mmap

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_wire_splice import _strip

from r3data.errors import WireFormatError
from r3data.wire import load_packed_body, pack_csr, pack_ndarray, splice
from r3data.wire.blob import direct_decoder

pytestmark = pytest.mark.skipif(
    splice._memchr() is None or direct_decoder() is None,
    reason="no memchr or no direct decoder: load_packed_body only has the plain path",
)
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # the patches the fixtures make hold for every example
FIELDS = ("routed_experts", "mask")
BAD = [b'"', b"\\", b"=", b"*", b" ", b"\n", b"\xff", b"}"]


def _body(sizes: list[int], bare: list[bool], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    choices = []
    for index, (size, plain) in enumerate(zip(sizes, bare, strict=True)):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        value = base64.b64encode(data.tobytes()).decode() if plain else pack_ndarray(data)
        choices.append({"index": index, "text": "x" * index, "routed_experts": value})
    return orjson.dumps({"id": "cmpl", "choices": choices, "mask": None})


def _outcome(raw, monkeypatch, *, plain: bool):
    """``load_packed_body(raw)`` as comparable values, or its error's type and text."""
    with monkeypatch.context() as patch:
        if plain:
            patch.setattr(splice, "_memchr", lambda: None)
        try:
            return _strip(load_packed_body(raw, FIELDS))
        except WireFormatError as err:
            return type(err), str(err)


@pytest.fixture(params=[1, 3, 16, 1 << 18], ids=lambda n: f"groups{n}")
def ahead(request, monkeypatch):
    """Decode ahead from the second blob on, ``request.param`` groups a chunk; counts the
    direct decoder's calls from splice (so a test can tell the path was taken)."""
    monkeypatch.setattr(splice, "AHEAD_MIN", 1)
    monkeypatch.setattr(splice, "AHEAD_GROUPS", request.param)
    calls = []
    direct = direct_decoder()

    def counted(*args):
        calls.append(args[1])
        return direct(*args)

    monkeypatch.setattr(splice, "direct_decoder", lambda: counted)
    return calls


sizes = st.lists(st.integers(0, 200), min_size=1, max_size=6)


@SETTINGS
@given(sizes=sizes, data=st.data())
def test_bodies_decode_as_the_plain_path_does(ahead, monkeypatch, sizes, data):
    bare = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    raw = _body(sizes, bare)
    assert _outcome(raw, monkeypatch, plain=False) == _outcome(raw, monkeypatch, plain=True)


@SETTINGS
@given(sizes=sizes, data=st.data())
def test_a_corrupted_body_fails_as_the_plain_path_does(ahead, monkeypatch, sizes, data):
    raw = bytearray(_body(sizes, [False] * len(sizes)))
    blobs = [i for i in range(len(raw)) if raw[i - 8 : i] == b'"data":"']
    blob = data.draw(st.sampled_from(blobs))
    at = data.draw(st.integers(blob, min(len(raw) - 1, blob + 300)))
    how = data.draw(st.sampled_from(["replace", "delete", "insert", "truncate"]))
    bad = data.draw(st.sampled_from(BAD))
    if how == "replace":
        raw[at : at + 1] = bad
    elif how == "delete":
        del raw[at]
    elif how == "insert":
        raw[at:at] = bad
    else:
        del raw[at:]
    raw = bytes(raw)
    assert _outcome(raw, monkeypatch, plain=False) == _outcome(raw, monkeypatch, plain=True)


def test_the_path_is_taken_from_the_second_blob(ahead, monkeypatch):
    raw = _body([90, 90, 60, 120], [False, True, False, True])
    assert _outcome(raw, monkeypatch, plain=False) == _outcome(raw, monkeypatch, plain=True)
    assert ahead  # the direct decoder ran from splice
    for index, choice in enumerate(load_packed_body(raw)["choices"]):
        value = choice["routed_experts"]
        if index % 2:
            assert type(value) is bytearray
        else:
            assert value["data"].flags.writeable
            assert value["data"].flags.c_contiguous


def test_an_invalid_character_deep_in_a_blob_is_named_as_before(ahead, monkeypatch):
    raw = bytearray(_body([300, 300], [False, False]))
    second = raw.rindex(b'"data":"') + 8
    raw[second + 201] = ord("*")
    outcome = _outcome(bytes(raw), monkeypatch, plain=False)
    assert outcome == _outcome(bytes(raw), monkeypatch, plain=True)
    assert outcome[0] is WireFormatError
    assert "invalid base64 in characters" in outcome[1]


def test_small_blobs_take_the_plain_path(monkeypatch):
    calls = []
    direct = direct_decoder()
    monkeypatch.setattr(splice, "direct_decoder", lambda: calls.append(1) or direct)
    load_packed_body(_body([1000] * 4, [False] * 4))
    assert not calls  # under AHEAD_MIN, nothing is decoded ahead


@pytest.mark.parametrize(
    "sizes",
    [
        [200_000, 200_000, 200_000],  # the same size: decoded in one pass each
        [300_000, 100_000, 299_999, 299_998],  # smaller after larger: the buffer shrinks
        [100_000, 300_001, 70_000, 2_500_000],  # larger after smaller: the rest decodes after
    ],
)
def test_large_blobs_of_any_sizes_decode_as_the_plain_path_does(monkeypatch, sizes):
    raw = _body(sizes, [False, True] * (len(sizes) // 2) + [False] * (len(sizes) % 2))
    assert _outcome(raw, monkeypatch, plain=False) == _outcome(raw, monkeypatch, plain=True)


@pytest.mark.parametrize("kind", ["bytearray", "mmap"])
def test_a_mutable_body_is_released_after_the_call(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(splice, "AHEAD_MIN", 1)
    data = _body([100, 100, 100], [False] * 3)
    if kind == "bytearray":
        raw = bytearray(data)
        load_packed_body(raw)
        with pytest.raises(WireFormatError):
            load_packed_body(raw + b"]")
        raw += b" "  # resizing needs every buffer export gone
    else:
        path = tmp_path / "body.json"
        path.write_bytes(data)
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as raw:
            load_packed_body(raw)
        # leaving the block closes the mmap, which needs every buffer export gone


@pytest.mark.parametrize("padding", [b"=", b"=="])
def test_padding_ending_any_group_before_the_last_fails_as_the_plain_path_does(
    ahead, monkeypatch, padding
):
    raw = _body([60, 60], [False, False])
    second = raw.rindex(b'"data":"') + 8
    for group in range(20):  # every group of the 80 characters but the last
        at = second + 4 * group + 4 - len(padding)
        bad = raw[:at] + padding + raw[at + len(padding) :]
        outcome = _outcome(bad, monkeypatch, plain=False)
        assert outcome == _outcome(bad, monkeypatch, plain=True), group
        assert outcome[0] is WireFormatError


def test_a_buffer_cut_to_a_smaller_blob_holds_no_more_than_it(monkeypatch):
    monkeypatch.setattr(splice, "AHEAD_MIN", 1)
    root = load_packed_body(_body([3000, 2999, 2000, 3000, 100], [True, True, True, False, False]))
    for choice in root["choices"][:3]:
        value = choice["routed_experts"]
        assert value.__alloc__() <= len(value) + 1
    for choice in root["choices"][3:]:
        array = choice["routed_experts"]["data"]
        while array.base is not None and isinstance(array.base, np.ndarray):
            array = array.base
        assert array.nbytes == choice["routed_experts"]["data"].nbytes


def test_each_field_sizes_its_own_buffer(monkeypatch):
    rng = np.random.default_rng(3)
    choices = [
        {
            "routed_experts": pack_ndarray(rng.integers(0, 128, (size, 48, 8), dtype=np.uint8)),
            "mask": pack_csr(rng.integers(0, 9, 4 * size).astype(np.int32), np.full(size, 4)),
        }
        for size in (400, 300, 500, 500)
    ]
    raw = orjson.dumps({"choices": choices})
    calls = []
    direct = direct_decoder()
    monkeypatch.setattr(splice, "direct_decoder", lambda: calls.append(1) or direct)
    assert _outcome(raw, monkeypatch, plain=False) == _outcome(raw, monkeypatch, plain=True)
    assert len(calls) == 3  # routes from the second blob on; mask members (32 KiB at most) never
