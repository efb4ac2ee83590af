"""Base64 decoded straight into place: any byte range of any blob, through libbase64's direct
decode and through pybase64's bounce alike, equals slicing a plain decode; bad characters are
refused wherever they sit."""

from __future__ import annotations

import numpy as np
import pybase64
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3data.errors import WireFormatError
from r3data.wire import blob
from r3data.wire.blob import decode_base64_into


@pytest.fixture(params=["direct", "bounce", "small"])
def decoder(request, monkeypatch):
    """``direct``: libbase64 wherever it can; ``bounce``: pybase64 only; ``small``: as
    shipped (short ranges in one bounce, long ones direct)."""
    if request.param == "bounce":
        monkeypatch.setattr(blob, "direct_decoder", lambda: None)
    elif blob.direct_decoder() is None:
        pytest.skip("this pybase64 build exports no base64_decode")
    elif request.param == "direct":
        monkeypatch.setattr(blob, "_SMALL_RANGE", 0)
    return request.param


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=3000), st.data(), st.sampled_from(["bytes", "memoryview", "str"]))
def test_any_range_decodes_into_place(decoder, raw, data, form):
    encoded = pybase64.b64encode(raw)
    source = {"bytes": encoded, "memoryview": memoryview(encoded), "str": encoded.decode()}[form]
    skip = data.draw(st.integers(0, len(raw)))
    size = data.draw(st.integers(0, len(raw) - skip))
    out = np.full(size, 0xAB, np.uint8)
    seen = []
    decode_base64_into(source, out, skip=skip, on_bytes=seen.append)
    assert out.tobytes() == raw[skip : skip + size]
    assert seen == sorted(seen)
    assert not size or seen[-1] == size


def test_chunks_larger_than_the_bounce_and_bad_characters_anywhere(decoder):
    raw = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    encoded = bytearray(pybase64.b64encode(raw))
    out = np.empty(len(raw) - 7, np.uint8)
    decode_base64_into(bytes(encoded), out, skip=7)
    assert out.tobytes() == raw[7:]
    # the first group, one inside the bulk, the last whole one, the padded last group, and
    # the group a range starting at byte 7 cuts
    for at, skip in ((0, 0), (3 << 20, 0), (len(encoded) - 5, 0), (len(encoded) - 3, 0), (9, 7)):
        bad = bytearray(encoded)
        bad[at] = ord("!")
        with pytest.raises(WireFormatError, match="invalid base64 in characters"):
            decode_base64_into(bytes(bad), np.empty(len(raw) - skip, np.uint8), skip=skip)
    with pytest.raises(WireFormatError, match="inside the"):
        decode_base64_into(bytes(encoded), np.empty(len(raw) + 1, np.uint8))


@pytest.mark.parametrize("size", [1, 2, 5])
def test_padding_inside_a_blob_is_refused_not_skipped(decoder, size):
    # "QQ==" (one byte, padded) then "QkNE": a whole decode refuses it, so must any range
    # whose groups reach the padded one (else the next group's bytes would slide in)
    with pytest.raises(WireFormatError, match="invalid base64 in characters"):
        decode_base64_into(b"QQ==QkNE", np.empty(size, np.uint8))
