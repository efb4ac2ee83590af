"""load_packed_body: one-pass splicing of envelope blobs out of raw JSON bodies."""

from __future__ import annotations

import base64
import json
import mmap
import re

import numpy as np
import orjson
import pytest

from r3data.errors import ConfigError, WireFormatError
from r3data.wire import load_packed_body, pack_csr, pack_ndarray, splice


def _routes(seed: int, rows: int = 5, dtype=np.uint8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200, size=(rows, 3, 2)).astype(dtype)


def _strip(obj):
    """``obj`` with every decoded array or blob replaced by a comparable tuple."""
    if isinstance(obj, dict):
        return {key: _strip(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_strip(value) for value in obj]
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.name, obj.shape, obj.tobytes())
    if isinstance(obj, bytearray):
        return ("bytes", bytes(obj))
    return obj


def _expected(obj, fields):
    """What load_packed_body must return, computed the slow way from a parsed body."""
    if isinstance(obj, list):
        return [_expected(value, fields) for value in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        if key in fields and isinstance(value, str):
            out[key] = ("bytes", base64.b64decode(value))
        elif key in fields and isinstance(value, dict) and "data" in value:
            array = np.frombuffer(base64.b64decode(value["data"]), value["dtype"])
            out[key] = {**value, "data": _strip(array.reshape(value["shape"]))}
        elif key in fields and isinstance(value, dict):
            out[key] = {
                name: None
                if member is None
                else {
                    **member,
                    "data": _strip(
                        np.frombuffer(base64.b64decode(member["data"]), member["dtype"]).reshape(
                            member["shape"]
                        )
                    ),
                }
                for name, member in value.items()
            }
        else:
            out[key] = _expected(value, fields)
    return out


TRICKY = {
    "id": "cmpl-1",
    "note": 'a string that says "routed_experts": "AAAA" and {"data": "x"}',
    "my_routed_experts": "not ours",
    "routed_experts_start": 3,
    "choices": [
        {
            "index": 0,
            "text": 'he wrote \\"routed_experts\\": \\"QUJD\\"',
            "routed_experts": pack_ndarray(_routes(0), start=2, meta={"routed_experts": "nested"}),
            "token_ids": list(range(40)),
        },
        {"index": 1, "routed_experts": None, "logprobs": [-0.5, -1.25]},
        {"index": 2},
        {
            "index": 3,
            "routed_experts": base64.b64encode(b"bare .npy-like bytes").decode(),
            "choices": [{"routed_experts": pack_ndarray(_routes(1, 4, np.uint16))}],
        },
        {
            "index": 4,
            "sampling_mask": pack_csr([5, 6, 7], [2, 0, 1]),
            "routed_experts": pack_ndarray(_routes(2, 0)),
        },
        {"index": 5, "sampling_mask": {"ids": None, "counts": pack_ndarray(np.zeros(0, np.int32))}},
    ],
    "unicode": "ünïcödé ✓",
}
FIELDS = ("routed_experts", "sampling_mask")


@pytest.mark.parametrize(
    "dump",
    [
        orjson.dumps,
        lambda obj: json.dumps(obj).encode(),
        lambda obj: json.dumps(obj, indent=2, ensure_ascii=False).encode(),
        lambda obj: json.dumps(obj, separators=(" ,", " : ")).encode(),
    ],
    ids=["orjson", "json", "indent", "spaced"],
)
def test_tricky_body_matches_the_slow_path(dump):
    raw = dump(TRICKY)
    parsed = load_packed_body(raw, FIELDS)
    assert _strip(parsed) == _expected(orjson.loads(raw), FIELDS)
    nested = parsed["choices"][3]["choices"][0]["routed_experts"]["data"]
    np.testing.assert_array_equal(nested, _routes(1, 4, np.uint16))
    assert parsed["choices"][0]["routed_experts"]["meta"] == {"routed_experts": "nested"}
    assert parsed["choices"][3]["routed_experts"] == bytearray(b"bare .npy-like bytes")
    assert parsed["note"] == TRICKY["note"]


def test_arrays_are_writable_and_fields_only_where_registered():
    raw = orjson.dumps(TRICKY)
    parsed = load_packed_body(raw, ("sampling_mask",))
    assert isinstance(parsed["choices"][0]["routed_experts"]["data"], str)
    ids = parsed["choices"][4]["sampling_mask"]["ids"]["data"]
    np.testing.assert_array_equal(ids, [5, 6, 7])
    ids[0] = 9  # decoded buffers are the caller's own
    assert ids[0] == 9


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, "mmap"])
def test_input_buffer_kinds(kind, tmp_path):
    raw = orjson.dumps(TRICKY)
    if kind == "mmap":
        path = tmp_path / "body.json"
        path.write_bytes(raw)
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            parsed = load_packed_body(m, FIELDS)
    else:
        parsed = load_packed_body(kind(raw), FIELDS)
    assert _strip(parsed) == _expected(orjson.loads(raw), FIELDS)


def test_top_level_list_and_no_registered_fields():
    raw = orjson.dumps([{"routed_experts": pack_ndarray(_routes(3))}, 5, "x"])
    parsed = load_packed_body(raw)
    np.testing.assert_array_equal(parsed[0]["routed_experts"]["data"], _routes(3))
    assert load_packed_body(b'{"a": [1, 2, {"b": null}]}') == {"a": [1, 2, {"b": None}]}


def _fails(raw: bytes, match: str, fields=FIELDS) -> WireFormatError:
    with pytest.raises(WireFormatError, match=match) as info:
        load_packed_body(raw, fields)
    return info.value


def test_data_not_first_names_field_and_offset():
    raw = b'{"x": 1, "routed_experts": {"shape": [1], "dtype": "uint8", "data": "AA=="}}'
    at = raw.index(b'{"shape"')
    _fails(raw, rf"field 'routed_experts' at byte {at}: expected an envelope with 'data'")


def test_unterminated_blob_names_field_and_offset():
    raw = orjson.dumps({"choices": [{"routed_experts": pack_ndarray(_routes(4))}]})
    cut = raw[: raw.index(b'"data":"') + 20]
    at = cut.index(b'"data":"') + len(b'"data":')
    _fails(cut, rf"field 'routed_experts': unterminated base64 string starting at byte {at}")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"routed_experts": {}}', "found an empty object"),
        (b'{"routed_experts": 5}', "expected a base64 string, an envelope object or null"),
        (b'{"routed_experts": [1]}', "expected a base64 string"),
        (b'{"routed_experts": {"data": null}}', "'data' to be a base64 string"),
        (
            b'{"routed_experts": {"data": "QUJD", "shape": [3], "dtype": "uint8"',
            "unterminated envelope",
        ),
        (b'{"routed_experts": "QU\\/DQUJ"}', "byte 19: invalid base64"),
        (b'{"routed_experts": "QUJ"}', "multiple of 4"),
        (
            b'{"routed_experts": "QU*D"}',
            r"field 'routed_experts' base64 string at byte 19: invalid base64",
        ),
        (
            b'{"routed_experts": {"data": "QUJD", "shape": [2], "dtype": "uint8"}}',
            "expected 2 bytes.*found 3",
        ),
        (b'{"routed_experts": {"data": "QUJD", "shape": [3], "dtype": "object"}}', "dtype"),
        (b'{"routed_experts": {"data": "QUJD", "shape": [3, -1], "dtype": "uint8"}}', "found -1"),
        (b'{"routed_experts": {"data": "QUJD"}}', r"missing \['shape', 'dtype'\]"),
        (b'{"routed_experts": "QUJD", "routed_experts": "QUJD"}', "missing from the parsed body"),
        (b'{"routed_experts": "QUJD"', "invalid JSON near byte 25"),
        (b'{"a": tru, "routed_experts": "QUJD"}', "invalid JSON near byte 6"),
        (
            b'{"sampling_mask": {"ids": {"data": "AAAAAA==", "shape": [1], "dtype": "int32"},}}',
            "trailing ','",
        ),
        (
            b'{"sampling_mask": {"ids": "AAAAAA=="}}',
            'found first key "ids"',
        ),
        (
            b'{"sampling_mask": {"ids": null, "counts": "AAAAAA=="}}',
            "'sampling_mask.counts' at byte 42: expected an envelope with 'data' first or null",
        ),
        (b'{"sampling_mask": {"ids": {"shape": [1], "data": "AAAAAA=="}}}', "'sampling_mask.ids'"),
        (b'{"sampling_mask": {"ids": null "counts": null}}', "expected ',' or '}'"),
        (b"", "invalid JSON near byte 0"),
    ],
)
def test_malformed_bodies(raw, match):
    _fails(raw, match)


def test_escaped_key_is_left_as_parsed():
    raw = b'{"routed\\u005fexperts": "QUJD", "x": {"routed_experts": "QUJD"}}'
    parsed = load_packed_body(raw)
    assert parsed["routed_experts"] == "QUJD"
    assert parsed["x"]["routed_experts"] == bytearray(b"ABC")


@pytest.mark.parametrize(
    "value", [b"0", b"1", b"-1", b'{"data": 0, "shape": [3], "dtype": "uint8"}']
)
def test_escaped_key_cannot_steal_a_blob(value):
    raw = b'{"routed\\u005fexperts": ' + value + b', "x": {"routed_experts": "QUJD"}}'
    parsed = load_packed_body(raw)
    assert parsed["routed_experts"] == orjson.loads(value)
    assert parsed["x"]["routed_experts"] == bytearray(b"ABC")


def test_rejects_non_bytes_and_bad_field_names():
    with pytest.raises(WireFormatError, match="found str"):
        load_packed_body('{"routed_experts": null}')
    with pytest.raises(ConfigError, match="at least one"):
        load_packed_body(b"{}", ())
    with pytest.raises(ConfigError, match="without escapes"):
        load_packed_body(b"{}", ('a"b',))


class _CountingPattern:
    """The real compiled key pattern, recording where each search starts and what it found."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.searches: list[tuple[int, bytes | None]] = []

    def search(self, raw: bytes, pos: int) -> re.Match[bytes] | None:
        match = self.pattern.search(raw, pos)
        self.searches.append((pos, None if match is None else match.group(1)))
        return match


def _scan_searches(
    monkeypatch, raw: bytes, fields: tuple[str, ...]
) -> list[tuple[int, bytes | None]]:
    """Every key search ``load_packed_body(raw, fields)`` makes, in order."""
    patterns = []
    real = splice._key_pattern

    def counting(names):
        patterns.append(_CountingPattern(real(names)))
        return patterns[-1]

    with monkeypatch.context() as patch:
        patch.setattr(splice, "_key_pattern", counting)
        load_packed_body(raw, fields)
    assert len(patterns) == 1
    return patterns[0].searches


def test_second_field_is_found_in_the_same_pass(monkeypatch):
    raw = orjson.dumps(TRICKY)
    one = load_packed_body(raw, ("routed_experts",))
    two = load_packed_body(raw, ("routed_experts", "sampling_mask"))
    assert _strip(two["choices"][0]) == _strip(one["choices"][0])
    assert isinstance(one["choices"][4]["sampling_mask"]["ids"]["data"], str)
    assert isinstance(two["choices"][4]["sampling_mask"]["ids"]["data"], np.ndarray)

    single = _scan_searches(monkeypatch, raw, ("routed_experts",))
    double = _scan_searches(monkeypatch, raw, ("routed_experts", "sampling_mask"))
    for searches in (single, double):
        starts = [pos for pos, _ in searches]
        assert starts == sorted(set(starts)), "a search went back over scanned bytes"
        assert [found for _, found in searches].count(None) == 1, "more than one sweep"
        assert searches[-1][1] is None
    found = [key for _, key in double if key is not None]
    assert found.count(b"sampling_mask") == raw.count(b'"sampling_mask":') == 2
    assert len(double) == len(single) + found.count(b"sampling_mask")


def test_offsets_in_errors_point_at_the_blob():
    good = pack_ndarray(_routes(5))
    bad = dict(good, shape=[99, 3, 2])
    raw = orjson.dumps({"choices": [{"routed_experts": good}, {"routed_experts": bad}]})
    second = [m.start() for m in re.finditer(rb'"data":', raw)][1] + len(b'"data":')
    _fails(raw, rf"envelope at byte {second}: expected 594 bytes")


def test_group_member_named_data_after_the_first():
    ids, counts = pack_ndarray(np.arange(3, dtype=np.int32)), pack_ndarray(np.ones(2, np.int32))
    raw = orjson.dumps({"sampling_mask": {"ids": ids, "data": counts}})
    parsed = load_packed_body(raw, ("sampling_mask",))
    np.testing.assert_array_equal(parsed["sampling_mask"]["ids"]["data"], [0, 1, 2])
    np.testing.assert_array_equal(parsed["sampling_mask"]["data"]["data"], [1, 1])
