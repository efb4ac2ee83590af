"""PayloadSegment validation, the prime-rl dict form, and the segment algebra (property tests)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data.errors import SegmentError
from r3data.payload import INDEX_DTYPE, PayloadSegment, clip, covers, gaps, shift

SETTINGS = settings(max_examples=60, deadline=None)
DTYPES = ["uint8", "uint16", "int32", "int64", "float32", "bool"]


@st.composite
def segment_lists(draw, field: str = "routes"):
    """Segments of one field at random positions (possibly overlapping), fixed or ragged."""
    ragged = draw(st.booleans())
    dtype = "int32" if ragged else draw(st.sampled_from(DTYPES))
    shape = () if ragged else tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    out = []
    for i in range(draw(st.integers(0, 5))):
        out.append(
            PayloadSegment(
                field,
                f"v{i}/f{i}.bin",
                offset=draw(st.integers(0, 10_000)),
                pos=draw(st.integers(0, 60)),
                rows=draw(st.integers(0, 20)),
                dtype=dtype,
                shape=shape,
                index=draw(st.integers(0, 10_000)) if ragged else None,
                crc32c=draw(st.none() | st.integers(0, 2**32 - 1)),
            )
        )
    return out


def row_address(s: PayloadSegment, p: int) -> tuple[str, int]:
    """Where the bytes (or, ragged, the index entry) of position ``p`` live."""
    assert s.pos <= p < s.end
    if s.ragged:
        return s.file, s.index + (p - s.pos) * INDEX_DTYPE.itemsize
    return s.file, s.offset + (p - s.pos) * s.row_bytes


def addresses(segments: list[PayloadSegment]) -> list[tuple[int, tuple[str, int]]]:
    return [(p, row_address(s, p)) for s in segments for p in range(s.pos, s.end)]


@SETTINGS
@given(segment_lists(), st.integers(0, 90), st.integers(0, 90))
def test_clip_keeps_exactly_the_rows_inside_and_their_bytes(segments, a, b):
    lo, hi = min(a, b), max(a, b)
    clipped = clip(segments, lo, hi)
    expected = [(p, where) for p, where in addresses(segments) if lo <= p < hi]
    assert addresses(clipped) == expected
    assert all(s.rows > 0 and lo <= s.pos and s.end <= hi for s in clipped)
    for part in clipped:
        source = next(s for s in segments if s.file == part.file)
        if (part.pos, part.rows) == (source.pos, source.rows):
            assert part.crc32c == source.crc32c
        else:
            assert part.crc32c is None
            assert (part.offset if part.ragged else part.index) == (
                source.offset if source.ragged else source.index
            )


@SETTINGS
@given(segment_lists(), st.integers(0, 90), st.integers(0, 90), st.integers(0, 90))
def test_clip_pieces_stitch_back_at_every_boundary(segments, a, b, c):
    lo, mid, hi = sorted((a, b, c))
    stitched = clip(segments, lo, mid) + clip(segments, mid, hi)
    assert sorted(addresses(stitched)) == sorted(addresses(clip(segments, lo, hi)))


@SETTINGS
@given(segment_lists(), st.integers(-60, 60))
def test_shift_moves_positions_not_bytes(segments, delta):
    if any(s.pos + delta < 0 for s in segments):
        with pytest.raises(SegmentError, match="below 0"):
            shift(segments, delta)
        return
    moved = shift(segments, delta)
    assert addresses(moved) == [(p + delta, where) for p, where in addresses(segments)]


@SETTINGS
@given(segment_lists(), st.integers(0, 90), st.integers(0, 90), st.integers(0, 60))
def test_clipped_and_shifted_handles_are_what_validation_makes_of_them(segments, a, b, delta):
    """Derived handles skip validation: each must equal the handle its dict validates to,
    field for field (ints stay ints, the checksum of a cut is gone)."""
    lo, hi = min(a, b), max(a, b)
    for derived in clip(segments, lo, hi) + shift(segments, delta):
        again = PayloadSegment.from_dict(derived.to_dict())
        assert again == derived
        assert vars(again) == vars(derived)
        assert all(type(v) is type(vars(again)[k]) for k, v in vars(derived).items())


@SETTINGS
@given(segment_lists(), st.integers(0, 90), st.integers(0, 90), st.integers(0, 60))
def test_sizes_follow_the_fields_of_every_handle(segments, a, b, delta):
    """Sizes are stored once per handle: every handle, made or derived (clipped, shifted,
    replaced), must still have the sizes its fields give, and keep them."""
    lo, hi = min(a, b), max(a, b)
    derived = clip(segments, lo, hi) + shift(segments, delta)
    derived += [replace(s, rows=s.rows + 1, pos=s.pos + 2) for s in segments]
    for s in segments + derived:
        itemsize = np.dtype(s.dtype).itemsize
        row_bytes = itemsize * int(np.prod(s.shape, dtype=np.int64))
        nbytes = (s.rows + 1) * INDEX_DTYPE.itemsize if s.index is not None else s.rows * row_bytes
        assert (s.end, s.nbytes, s.row_bytes, s.itemsize) == (
            s.pos + s.rows,
            nbytes,
            row_bytes,
            itemsize,
        )
        assert (s.ragged, s.row_shape) == (s.index is not None, s.shape)
        with pytest.raises(FrozenInstanceError):
            s.nbytes = 0  # type: ignore[misc]


@SETTINGS
@given(segment_lists(), st.integers(0, 90), st.integers(0, 90))
def test_gaps_and_covers_match_a_coverage_model(segments, a, b):
    lo, hi = min(a, b), max(a, b)
    other = [PayloadSegment("mask", "v0/x.bin", 0, 0, 200, "int32")]
    covered = np.zeros(hi, bool)
    for s in segments:
        covered[s.pos : min(s.end, hi)] = True
    runs, p = [], lo
    while p < hi:
        if covered[p]:
            p += 1
            continue
        start = p
        while p < hi and not covered[p]:
            p += 1
        runs.append((start, p))
    assert gaps(segments + other, "routes", lo, hi) == runs
    assert covers(segments + other, "routes", lo, hi) == (not runs)


@SETTINGS
@given(segment_lists())
def test_dict_round_trip_through_json(segments):
    for s in segments:
        data = orjson.loads(orjson.dumps(s.to_dict()))
        assert list(data)[:7] == ["field", "file", "offset", "pos", "rows", "dtype", "shape"]
        back = PayloadSegment.from_dict(data)
        assert back == s
        assert back.crc32c == s.crc32c


def test_prime_rl_handle_without_extensions():
    handle = {
        "field": "routed_experts",
        "file": "v7/abc.bin",
        "offset": 4096,
        "pos": 12,
        "rows": 30,
        "dtype": "uint8",
        "shape": [48, 8],
        "future_key": "ignored",
    }
    s = PayloadSegment.from_dict(handle)
    assert (s.end, s.row_bytes, s.nbytes, s.ragged) == (42, 384, 30 * 384, False)
    assert s.to_dict() == {k: v for k, v in handle.items() if k != "future_key"}


def test_sizes_of_ragged_and_fixed_segments():
    fixed = PayloadSegment("routes", "a.bin", 0, 0, 5, "uint16", (3, 2))
    assert (fixed.itemsize, fixed.row_bytes, fixed.nbytes) == (2, 12, 60)
    ragged = PayloadSegment("mask", "a.bin", 0, 0, 5, "int32", index=64)
    assert (ragged.itemsize, ragged.row_bytes, ragged.nbytes) == (4, 4, 6 * 8)


def test_dtype_names_are_canonical():
    assert PayloadSegment("f", "a.bin", 0, 0, 1, "<u2").dtype == "uint16"
    assert PayloadSegment("f", "a.bin", 0, 0, 1, np.dtype("int32")).dtype == "int32"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"offset": -1}, "offset: expected an int in \\[0, 9223372036854775807\\], found -1"),
        (
            {"offset": 2**63},
            "offset: expected an int in \\[0, 9223372036854775807\\], found 9223372036854775808",
        ),
        ({"index": 2**63}, "index: expected an int in \\[0, 9223372036854775807\\]"),
        ({"offset": 2**63 - 1}, "expected bytes that end by 9223372036854775807, found bytes"),
        ({"rows": 1.5}, "rows: expected an int >= 0, found 1.5"),
        ({"pos": True}, "pos: expected an int >= 0, found True"),
        ({"dtype": ">u2"}, "big-endian"),
        ({"dtype": "object"}, "dtype"),
        ({"shape": "48x8"}, "shape must be a list"),
        ({"shape": [48, -8]}, "shape entry: expected an int >= 0, found -8"),
        ({"field": ""}, "field must be a non-empty string"),
        ({"file": 3}, "file must be a non-empty string"),
        ({"index": 8, "shape": [2]}, "must have row shape"),
        ({"crc32c": 2**32}, "crc32c: expected an int in \\[0, 4294967295\\], found 4294967296"),
    ],
)
def test_invalid_segments_are_refused(change, message):
    data = {"field": "f", "file": "a.bin", "offset": 0, "pos": 0, "rows": 1, "dtype": "uint8"}
    data["shape"] = [2]
    data.update(change)
    with pytest.raises(SegmentError, match=message):
        PayloadSegment.from_dict(data)


def test_from_dict_names_missing_keys():
    with pytest.raises(SegmentError, match=r"missing \['rows', 'shape'\]"):
        PayloadSegment.from_dict(
            {"field": "f", "file": "a", "offset": 0, "pos": 0, "dtype": "uint8"}
        )
    with pytest.raises(SegmentError, match="JSON object"):
        PayloadSegment.from_dict([1, 2])


def test_range_arguments_are_checked():
    s = [PayloadSegment("f", "a.bin", 0, 0, 4, "uint8")]
    with pytest.raises(SegmentError, match="0 <= lo <= hi"):
        clip(s, 3, 2)
    with pytest.raises(SegmentError, match="0 <= lo <= hi"):
        gaps(s, "f", -1, 2)
    with pytest.raises(SegmentError, match="delta must be an int"):
        shift(s, 1.0)
