"""The wire dtype registry and the InlineRows record."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from r3data.errors import R3DataError, SegmentError, WireFormatError
from r3data.wire import ALL_DTYPES, ROUTE_DTYPES, InlineRows, parse_dtype


@pytest.mark.parametrize("name", sorted(ALL_DTYPES))
def test_every_allowed_name_parses_to_itself(name):
    assert parse_dtype(name).name == name
    assert parse_dtype(np.dtype(name)) == np.dtype(name)


@pytest.mark.parametrize(
    ("spelling", "name"), [("<u2", "uint16"), ("|u1", "uint8"), ("i4", "int32"), ("<f2", "float16")]
)
def test_little_endian_spellings(spelling, name):
    assert parse_dtype(spelling).name == name


def test_route_dtypes_are_the_integer_ladder():
    assert [d.name for d in ROUTE_DTYPES] == ["uint8", "uint16", "int32", "int64", "int8", "int16"]
    assert parse_dtype("uint16", ROUTE_DTYPES) == np.uint16


@pytest.mark.parametrize(
    "bad",
    [
        ">u2",
        ">f4",
        "object",
        "O",
        "U8",
        "S4",
        "V8",
        "complex64",
        "datetime64[ns]",
        "u1,u1",
        "(2,)i4",
        "nope",
        "",
        7,
        None,
        ["uint8"],
        True,
    ],
)
def test_rejected_dtypes_name_what_was_found(bad):
    with pytest.raises(WireFormatError, match="dtype: expected") as info:
        parse_dtype(bad)
    assert isinstance(info.value, R3DataError)


@pytest.mark.parametrize("bad", ["a", "a4", "<a2", "|a1"])
def test_numpys_deprecated_bytes_alias_is_refused_without_a_warning(bad):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(WireFormatError, match=f"found unknown dtype '{re.escape(bad)}'"):
            parse_dtype(bad)


def test_allowed_narrows_and_names_the_allowed_set():
    with pytest.raises(WireFormatError, match=r"\['uint16', 'uint8'\].*found '<f4' \(float32\)"):
        parse_dtype("float32", ["uint8", np.uint16])


def test_inline_rows_properties_and_frozen_meta():
    rows = InlineRows("routed_experts", np.zeros((5, 2, 4), np.uint8), 7, {"choice": 1})
    assert (rows.rows, rows.end, rows.row_shape) == (5, 12, (2, 4))
    assert rows.meta["choice"] == 1
    with pytest.raises(TypeError):
        rows.meta["choice"] = 2  # type: ignore[index]
    assert dict(InlineRows("f", np.zeros(3), np.int64(0)).meta) == {}


@pytest.mark.parametrize(
    ("field", "array", "pos"),
    [
        ("", np.zeros(3), 0),
        ("f", np.float32(1.0), 0),
        ("f", [1, 2], 0),
        ("f", np.zeros(3), -1),
        ("f", np.zeros(3), True),
        ("f", np.zeros(3), 1.5),
    ],
)
def test_inline_rows_validation(field, array, pos):
    with pytest.raises(SegmentError):
        InlineRows(field, array, pos)
