"""SkyRL: routes as a generic envelope ``{"data": base64, "shape": [...], "dtype": name, ...}``.

``data`` comes first so the body can be spliced; the sidecar may carry the first position as
``start`` (or ``pos``). The envelope is accepted on its own, under ``field`` in an object, in
each of ``choices``, or in each item of a list. A raw body is spliced for ``field``; a body
that is a bare envelope has no key to splice on and is parsed plainly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r3data.errors import ConfigError, WireFormatError
from r3data.wire.dtypes import ROUTE_DTYPES
from r3data.wire.envelope import envelope_spec
from r3data.wire.producers.common import (
    check_route_shape,
    envelope_rows,
    optional_position,
    parse_response,
)
from r3data.wire.rows import RowSource

__all__ = ["skyrl_routes"]


def _envelopes(parsed: Any, field: str) -> list[tuple[str, Any]]:
    if isinstance(parsed, list):
        return [
            (f"[{i}]", item.get(field, item) if isinstance(item, Mapping) else item)
            for i, item in enumerate(parsed)
        ]
    if isinstance(parsed, Mapping) and "data" in parsed:
        return [("", parsed)]
    if isinstance(parsed, Mapping) and field in parsed:
        return [(f".{field}", parsed[field])]
    if isinstance(parsed, Mapping) and isinstance(parsed.get("choices"), list):
        return [
            (f".choices[{i}].{field}", entry.get(field) if isinstance(entry, Mapping) else entry)
            for i, entry in enumerate(parsed["choices"])
        ]
    raise WireFormatError(
        f"skyrl response: expected an envelope, {field!r}, or 'choices' with {field!r}"
    )


def skyrl_routes(
    response: Any,
    *,
    pos: int | None = None,
    field: str = "routed_experts",
) -> list[RowSource]:
    """Routes from SkyRL envelopes, one :class:`InlineRows` per envelope found.

    The first position is ``pos`` when given, else the sidecar's ``start`` or ``pos``, else 0
    (routes for the whole sequence). ``meta`` holds ``producer``, ``where`` and the sidecar.
    """
    pos_arg = optional_position(pos, "pos", ConfigError)
    parsed = parse_response(response, (field,))
    out = []
    for where, envelope in _envelopes(parsed, field):
        what = f"skyrl response{where}"
        dtype, shape, sidecar = envelope_spec(
            envelope, allowed_dtypes=ROUTE_DTYPES, ndim=3, what=what
        )
        first = pos_arg
        for key in ("start", "pos"):
            if first is None:
                first = optional_position(sidecar.get(key), f"{what}.{key}", WireFormatError)
        meta = {"producer": "skyrl", "where": where, "sidecar": sidecar}
        rows = envelope_rows(envelope, field, dtype, shape, pos=first or 0, meta=meta, what=what)
        check_route_shape(rows, what)
        out.append(rows)
    return out
