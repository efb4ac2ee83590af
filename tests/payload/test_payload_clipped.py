"""A segment a prefill/decode router clipped (PrimeIntellect-ai/router
``merge_routed_payload_in_json``: ``offset``, ``pos`` and ``rows`` moved, every other key, the
``crc32c`` of the field as written included, copied) reads its rows: the file's own table and
the field, checked whole, vouch for them. Anything else that does not match its checksum is
still refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from r3data import loader
from r3data.errors import PayloadChecksumError
from r3data.payload import PayloadReader, PayloadWriter
from r3data.wire.segment import PayloadSegment

LAYERS, TOPK = 3, 2
PROMPT, COMPLETION = 6, 4
ROWS = PROMPT + COMPLETION - 1
ROW_BYTES = LAYERS * TOPK


def router_merge(prefill: list[dict], decode: list[dict]) -> list[dict]:
    """The router's merge of by-handle segments: prefill's first, then the decode's rows from
    where the prefill's end, each clipped by moving its offset, pos and rows."""
    cut = max(s["pos"] + s["rows"] for s in prefill)
    merged = [dict(s) for s in prefill]
    for s in decode:
        s = dict(s)
        if s["pos"] + s["rows"] <= cut:
            continue
        if s["pos"] < cut:
            skipped = cut - s["pos"]
            s.update(offset=s["offset"] + skipped * ROW_BYTES, pos=cut, rows=s["rows"] - skipped)
        merged.append(s)
    return merged


@pytest.fixture
def merged(tmp_path):
    """The true rows, and the merged segments of a prefill and a decode instance's files (the
    decode's prompt rows are not the prefill's: it never ran the prompt)."""
    rng = np.random.default_rng(3)
    truth = rng.integers(1, 200, (ROWS, LAYERS, TOPK)).astype(np.uint8)
    writer = PayloadWriter(tmp_path)
    prefill = [s.to_dict() for s in writer.write(1, {"routed_experts": truth[:PROMPT]})]
    decoded = truth.copy()
    decoded[:PROMPT] = 0
    decode = [s.to_dict() for s in writer.write(1, {"routed_experts": decoded})]
    return tmp_path, truth, router_merge(prefill, decode)


def test_a_clipped_decode_segment_reads_its_rows(merged):
    root, truth, segments = merged
    clipped = PayloadSegment.from_dict(segments[1])
    assert (clipped.pos, clipped.rows) == (PROMPT, ROWS - PROMPT)
    reader = PayloadReader(root)
    got = reader.read([PayloadSegment.from_dict(s) for s in segments])["routed_experts"]
    np.testing.assert_array_equal(got, truth)


def test_the_loader_reads_a_merged_prime_rl_response(merged):
    root, truth, segments = merged
    choice = {"index": 0, "token_ids": [7] * COMPLETION, "payload": segments}
    response = json.dumps({"request_id": "r", "choices": [choice]}).encode()
    request = {
        "prompt_len": PROMPT,
        "completion_len": COMPLETION,
        "sources": [{"producer": "prime-rl", "response": response}],
    }
    sample = {"id": "pd", "token_ids": np.arange(PROMPT + COMPLETION), "requests": [request]}
    (batch,) = loader([sample], batch_size=1, payload_root=str(root), prefetch=0)
    np.testing.assert_array_equal(batch["routed_experts"][0].numpy()[:ROWS], truth)
    assert batch["routed_experts_valid"][0].numpy()[:ROWS].all()


@pytest.mark.parametrize(
    ("offset", "pos", "rows", "crc_flip"),
    [
        (0, 1, -1, 0),  # rows placed where the table has others
        (-ROW_BYTES // 2, 0, 0, 0),  # not on a row's first byte
        (-ROW_BYTES, -1, 1, 1),  # the table's rows, but another checksum than the field's
    ],
    ids=["moved-rows", "half-row", "another-checksum"],
)
def test_a_segment_its_field_does_not_vouch_for_is_refused(merged, offset, pos, rows, crc_flip):
    root, _, segments = merged
    clipped = PayloadSegment.from_dict(segments[1])
    moved = dataclasses.replace(
        clipped,
        offset=clipped.offset + offset,
        pos=clipped.pos + pos,
        rows=clipped.rows + rows,
        crc32c=clipped.crc32c ^ crc_flip,
    )
    with pytest.raises(PayloadChecksumError, match="checksum mismatch"):
        PayloadReader(root, retries=0).read([moved])
    if crc_flip:  # the same rows with the field's checksum: vouched for
        unflipped = dataclasses.replace(moved, crc32c=clipped.crc32c)
        assert PayloadReader(root).read([unflipped])["routed_experts"].shape[0] == moved.rows


def test_a_field_corrupt_outside_the_clipped_rows_is_refused(merged):
    """The clipped rows are intact, but the bytes the router cut off are not: the field no
    longer checks, so nothing vouches for the clipped part either."""
    root, _, segments = merged
    clipped = PayloadSegment.from_dict(segments[1])
    path = root / clipped.file
    data = bytearray(path.read_bytes())
    data[clipped.offset - 1] ^= 0xFF  # the last byte before the clipped rows
    path.write_bytes(bytes(data))
    with pytest.raises(PayloadChecksumError, match="checksum mismatch"):
        PayloadReader(root, retries=0).read([clipped])


def test_a_field_of_several_chunks_is_checked_chunk_by_chunk(tmp_path, monkeypatch):
    """The field is read again in pieces of at most CHUNK_BYTES (each under the timeout)."""
    import r3data.payload.reader as reader_module

    monkeypatch.setattr(reader_module, "CHUNK_BYTES", 4 * ROW_BYTES)
    rng = np.random.default_rng(4)
    truth = rng.integers(1, 200, (ROWS, LAYERS, TOPK)).astype(np.uint8)
    (written,) = PayloadWriter(tmp_path).write(1, {"routed_experts": truth})
    clipped = dataclasses.replace(written, offset=written.offset + 5 * ROW_BYTES, pos=5, rows=4)
    asked: list[int] = []
    real = reader_module.PayloadFile.stream

    def counting_stream(self, buffer_bytes):
        inner = self.read_at
        self.read_at = lambda offset, dest: asked.append(len(dest)) or inner(offset, dest)
        return real(self, buffer_bytes)

    monkeypatch.setattr(reader_module.PayloadFile, "stream", counting_stream)
    got = PayloadReader(tmp_path).read([clipped])["routed_experts"]
    np.testing.assert_array_equal(got, truth[5:])
    assert len(asked) > 2  # the header's one read, then the field's chunks
    assert max(asked[1:]) <= 4 * ROW_BYTES


def test_an_io_error_while_checking_the_field_is_no_checksum_error(merged, monkeypatch):
    import r3data.payload.reader as reader_module
    from r3data.errors import PayloadReadError

    root, _, segments = merged

    def failing(self, buffer_bytes):
        raise PayloadReadError(f"reading {self.url}: EIO")

    monkeypatch.setattr(reader_module.PayloadFile, "stream", failing)
    with pytest.raises(PayloadReadError, match="EIO") as raised:
        PayloadReader(root, retries=0).read([PayloadSegment.from_dict(segments[1])])
    assert not isinstance(raised.value, PayloadChecksumError)
