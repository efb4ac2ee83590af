"""Review of ``_Scanner._ahead``: libbase64's output contract, and a differential campaign.

libbase64's ``base64_decode`` may write anywhere in ``out[:srclen // 4 * 3]`` (its SIMD loops
store whole registers, zeros past the bytes they decode), so every call splice makes must fit
that span into what is left of the ahead buffer. The campaign builds bodies that trip the ahead
path (small chunks, blobs ending at, around and past the buffer's size, bad characters at and
around chunk boundaries and the buffer's limit) and compares ``load_packed_body`` with the plain
path (the same values, or the same error type and text) and with orjson + strict pybase64.
"""

from __future__ import annotations

import base64
import sys

import numpy as np
import orjson
import pybase64
import pytest
from test_wire_splice import _expected, _strip

from r3data.errors import WireFormatError
from r3data.wire import load_packed_body, splice
from r3data.wire.blob import direct_decoder

pytestmark = pytest.mark.skipif(
    splice._memchr() is None or direct_decoder() is None,
    reason="no memchr or no direct decoder: load_packed_body only has the plain path",
)
FIELDS = ("routed_experts", "mask")
BAD = [
    b'"',
    b"\\",
    b"\\/",
    b"=",
    b"==",
    b"*",
    b" ",
    b"\n",
    b"\xff",
    b"\xc3\xa9",
    b"\x00",
    b"}",
    b"-",
]


@pytest.fixture
def checked(monkeypatch):
    """splice's direct decoder, refusing any call whose output span (3/4 of its characters)
    does not fit what is left of the ahead buffer; returns the calls' character counts."""
    direct = direct_decoder()
    original = splice._Scanner._ahead
    room: dict[str, int] = {}
    calls: list[int] = []

    def ahead(self, field, start, bare):
        room.clear()
        room["size"] = self.largest.get(field, 0)
        return original(self, field, start, bare)

    def decode(source, count, target, got, flags):
        start = room.setdefault("start", target)  # the first call writes at the buffer's start
        assert target - start + count // 4 * 3 <= room["size"], (
            f"{count} characters decode past the {room['size']}-byte buffer "
            f"(at offset {target - start})"
        )
        calls.append(count)
        return direct(source, count, target, got, flags)

    monkeypatch.setattr(splice._Scanner, "_ahead", ahead)
    monkeypatch.setattr(splice, "direct_decoder", lambda: decode)
    return calls


def _outcome(raw, monkeypatch, *, plain: bool):
    """``load_packed_body(raw)`` as comparable values, or its error's type and text."""
    with monkeypatch.context() as patch:
        if plain:
            patch.setattr(splice, "AHEAD_MIN", 1 << 62)
        try:
            return _strip(load_packed_body(raw, FIELDS))
        except WireFormatError as err:
            return type(err), str(err)


def _reference(raw):
    """orjson + strict pybase64: the values, or WireFormatError when it refuses the body."""
    try:
        root = orjson.loads(raw)
        for choice in root["choices"]:
            for name in FIELDS:
                value = choice.get(name)
                members = value.values() if isinstance(value, dict) and "ids" in value else [value]
                for blob in members:
                    chars = blob["data"] if isinstance(blob, dict) else blob
                    if isinstance(chars, str):
                        pybase64.b64decode(chars, validate=True)
        return _strip(_expected(root, FIELDS))
    except (orjson.JSONDecodeError, ValueError, TypeError, KeyError):
        return WireFormatError


@pytest.mark.parametrize("bad", [b"==", b"A=", b"*A", b"A*", b" A"])
@pytest.mark.parametrize("size", [60, 61, 62])
def test_a_stop_at_the_buffers_limit_writes_nothing_past_it(checked, monkeypatch, bad, size):
    """The decoder stops in the last group that fits the buffer while the quote lies beyond
    it: re-decoding up to the quote's last group would hand libbase64 more characters than
    the buffer holds (a 5-byte heap overwrite with AVX-512 on a 66000-byte buffer)."""
    monkeypatch.setattr(splice, "AHEAD_MIN", 1)
    rng = np.random.default_rng(size)
    first = base64.b64encode(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    limit = size // 3 * 4
    second = bytearray(base64.b64encode(rng.integers(0, 256, size + 300, dtype=np.uint8).tobytes()))
    second[limit - 2 : limit] = bad
    raw = orjson.dumps(
        {"choices": [{"routed_experts": first.decode()}, {"routed_experts": second.decode()}]}
    )
    outcome = _outcome(raw, monkeypatch, plain=False)
    assert checked  # the ahead path ran
    assert outcome == _outcome(raw, monkeypatch, plain=True)
    assert outcome[0] is WireFormatError


def _envelope(chars: bytes, size: int, dtype: str) -> bytes:
    count = size // np.dtype(dtype).itemsize
    return b'{"data":"%s","shape":[%d],"dtype":"%s"}' % (chars, count, dtype.encode())


def _chars(rng: np.random.Generator, size: int) -> bytes:
    return base64.b64encode(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def _near(rng: np.random.Generator, sizes: list[int], largest: int) -> int:
    """A blob size at, around or far from the buffer an earlier blob set (``largest``) or a
    chunk boundary."""
    chunk = 3 * splice.AHEAD_GROUPS
    pick = rng.integers(6)
    if pick == 0:
        return max(0, largest + int(rng.integers(-4, 5)))
    if pick == 1:
        return max(0, chunk * int(rng.integers(1, 4)) + int(rng.integers(-4, 5)))
    if pick == 2:
        return sizes[int(rng.integers(len(sizes)))] if sizes else 0
    return int(rng.integers(0, 2 * largest + 40))


def _campaign_body(
    rng: np.random.Generator, first: int
) -> tuple[bytes, list[tuple[int, int, int]]]:
    """A body of choices with routes (bare or envelopes, the first of ``first`` bytes or more)
    and CSR-like masks, and each blob's ``(start, end, buffer)``: its characters, and the
    ahead buffer its field would size."""
    parts = [b'{"id":"cmpl","choices":[']
    spans: list[tuple[int, int, int]] = []
    largest: dict[str, int] = {}
    sizes: list[int] = []
    at = len(parts[0])

    def blob(field: str, size: int, dtype: str | None) -> bytes:
        """A bare blob (``dtype`` None) or an envelope of ``size`` bytes, its span noted."""
        chars = _chars(rng, size)
        text = b'"%s"' % chars if dtype is None else _envelope(chars, size, dtype)
        offset = text.index(chars) if chars else text.index(b'""') + 1
        spans.append((at + offset, at + offset + len(chars), largest.get(field, 0)))
        largest[field] = max(largest.get(field, 0), size)
        sizes.append(size)
        return text

    for index in range(int(rng.integers(2, 6))):
        head = b'%s{"index":%d,"routed_experts"%s:%s' % (
            b"," if index else b"",
            index,
            b" " * int(rng.integers(2)),
            b" " * int(rng.integers(2)),
        )
        parts.append(head)
        at += len(head)
        kind = rng.integers(5)
        size = _near(rng, sizes, largest.get("routed_experts", 0))
        if "routed_experts" not in largest:
            size += first
        if kind == 0:
            text = b"null"
        elif kind == 1:
            text = blob("routed_experts", size, None)
        else:
            dtype = "int16" if kind == 2 else "uint8"
            size -= size % np.dtype(dtype).itemsize
            text = blob("routed_experts", size, dtype)
        parts.append(text)
        at += len(text)
        if rng.integers(2):
            text = b',"mask":{"ids":'
            parts.append(text)
            at += len(text)
            text = blob("mask.ids", 4 * int(rng.integers(0, 40)), "int32")
            text += b',"counts":'
            parts.append(text)
            at += len(text)
            text = blob("mask.counts", 4 * int(rng.integers(0, 10)), "int32")
            parts.append(text + b"}")
            at += len(text) + 1
        parts.append(b"}")
        at += 1
    parts.append(b"]}")
    return b"".join(parts), spans


def _mutate(rng: np.random.Generator, raw: bytes, spans: list[tuple[int, int, int]]) -> bytes:
    """``raw`` with one blob damaged (or re-drawn) where the ahead path turns: at the buffer's
    limit, at a chunk boundary, at the blob's end, anywhere."""
    start, end, guess = spans[int(rng.integers(len(spans)))]
    chunk = 4 * splice.AHEAD_GROUPS
    anchors = [start + guess // 3 * 4, start + chunk * int(rng.integers(1, 4)), end]
    pick = rng.integers(4)
    at = anchors[pick] + int(rng.integers(-6, 3)) if pick < 3 else int(rng.integers(start, end + 1))
    at = min(max(at, start), end)
    how = rng.integers(6)
    bad = BAD[int(rng.integers(len(BAD)))]
    out = bytearray(raw)
    if how == 0:
        out[at : at + len(bad)] = bad
    elif how == 1:
        out[at:at] = bad
    elif how == 2:
        del out[at : at + int(rng.integers(1, 5))]
    elif how == 3:
        del out[at:]
    elif at < end:  # a valid character for another: the values must still agree
        out[at] = base64.b64encode(bytes([int(rng.integers(256))] * 3))[int(rng.integers(4))]
    return bytes(out)


def run_campaign(monkeypatch, cases: int, seed: int, *, first: int = 0, groups=(1, 2, 3, 16)):
    """Compare ``cases`` drawn bodies with the plain path and the reference; the bad ones."""
    rng = np.random.default_rng(seed)
    bad = 0
    for case in range(cases):
        with monkeypatch.context() as patch:
            patch.setattr(splice, "AHEAD_GROUPS", int(rng.choice(groups)))
            raw, spans = _campaign_body(rng, first)
            if spans and rng.integers(4):
                raw = _mutate(rng, raw, spans)
            body = bytearray(raw) if rng.integers(4) == 0 else raw
            got = _outcome(body, monkeypatch, plain=False)
            plain = _outcome(body, monkeypatch, plain=True)
            assert got == plain, (seed, case, raw)
            reference = WireFormatError if b"\\" in raw else _reference(raw)
            if reference is WireFormatError:
                assert isinstance(got, tuple), (seed, case, raw)
                assert got[0] is WireFormatError, (seed, case, raw)
            else:
                assert got == reference, (seed, case, raw)
            bad += isinstance(got, tuple)
    return bad


def test_a_drawn_campaign_matches_the_plain_path_and_the_reference(checked, monkeypatch):
    monkeypatch.setattr(splice, "AHEAD_MIN", 1)
    bad = run_campaign(monkeypatch, 1500, seed=20261202)
    assert 300 < bad < 1200  # both kinds of body were drawn
    assert checked


def test_a_campaign_after_a_large_first_blob_matches_too(checked):
    """As the shipped thresholds run: the first routes blob 64 KiB or more, chunks of a few
    thousand characters."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        bad = run_campaign(monkeypatch, 40, seed=7, first=splice.AHEAD_MIN, groups=(256, 1024))
    assert 0 < bad < 40
    assert checked


def test_small_bare_blobs_after_a_large_one_keep_no_large_buffer():
    """The ahead buffer is the size of the largest blob before; a small bare blob after it
    is handed back in a buffer of its own size, with the bytes the plain path gives."""
    rng = np.random.default_rng(5)
    sizes = [1 << 20] + [100] * 20 + [1 << 20]
    choices = [{"routed_experts": _chars(rng, size).decode()} for size in sizes]
    raw = orjson.dumps({"choices": choices})
    got = load_packed_body(raw)["choices"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splice, "AHEAD_MIN", 1 << 62)
        plain = load_packed_body(raw)["choices"]
    for ours, theirs in zip(got, plain, strict=True):
        blob = ours["routed_experts"]
        assert blob == theirs["routed_experts"]
        assert blob.__alloc__() <= len(blob) + 1


@pytest.mark.parametrize("size", [0, 1, 100, 1 << 20])
def test_an_unzeroed_bytearray_is_a_plain_one_of_its_size(size):
    made = splice._new_bytearray()(size)
    assert type(made) is bytearray
    assert len(made) == size
    plain = bytearray(size)
    assert sys.getrefcount(made) == sys.getrefcount(plain)  # no reference leaked
    made[size:] = b"abc"
    del made[:size]
    assert made == b"abc"
