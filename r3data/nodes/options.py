"""The loader's option objects for tracing and collation (screening: :class:`ScreenOptions`).

Frozen dataclasses (:func:`r3data.options.options`): a misspelt option is a ``ConfigError``
naming it and the valid ones; bad values are refused when the object is made, before any
sample is read. ``loader(..., trace=TraceOptions(on_gap="raise"))``, or a mapping of the same
fields (``trace={"on_gap": "raise"}``, as a YAML config gives it).
"""

from __future__ import annotations

from typing import Literal

from r3data.buffers import BufferPool
from r3data.errors import ConfigError
from r3data.options import options
from r3data.trace import ROUTES_FIELD, OnGap, Placeholder
from r3data.trace.builder import check_ragged_fields
from r3data.trace.stitch import check_on_gap
from r3data.validate import checked_int

__all__ = ["LENGTH_MISMATCH", "CollateOptions", "LengthMismatch", "TraceOptions"]

LengthMismatch = Literal["warn", "raise", "ignore"]
LENGTH_MISMATCH = ("warn", "raise", "ignore")


def _names(what: str, value: object) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{what}: expected distinct field names, found {value!r}")
    return names


@options
class TraceOptions:
    """How each sample's trace is built and stitched.

    ``routes_field``, ``ragged_fields`` and ``last_token_row`` shape the trace
    (:class:`~r3data.trace.TraceBuilder`); ``placeholder``, ``on_gap`` and ``topk`` stitch it
    (:func:`~r3data.trace.stitch`). ``length_mismatch``: what a sample whose ``token_ids`` are
    longer or shorter than its requests cover gets: a logged warning naming the sample and
    both counts (``"warn"``), a :class:`~r3data.errors.TraceError` (``"raise"``), or nothing.
    """

    routes_field: str = ROUTES_FIELD
    ragged_fields: tuple[str, ...] = ("sampling_mask",)
    last_token_row: bool = False
    placeholder: Placeholder = "repeat_previous"
    on_gap: OnGap = "drop_routes"
    topk: int | None = None
    length_mismatch: LengthMismatch = "warn"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ragged_fields", _names("ragged_fields", self.ragged_fields))
        if not isinstance(self.routes_field, str) or not self.routes_field:
            raise ConfigError(f"routes_field: expected a field name, found {self.routes_field!r}")
        check_ragged_fields(self.routes_field, self.ragged_fields)
        if not isinstance(self.last_token_row, bool):
            raise ConfigError(f"last_token_row: expected a bool, found {self.last_token_row!r}")
        if self.placeholder not in ("repeat_previous", "distinct"):
            raise ConfigError(
                f"placeholder: expected 'repeat_previous' or 'distinct', found {self.placeholder!r}"
            )
        check_on_gap(self.on_gap)
        if self.topk is not None:
            checked_int("topk", self.topk, minimum=1)
        if self.length_mismatch not in LENGTH_MISMATCH:
            raise ConfigError(
                f"length_mismatch: expected one of {list(LENGTH_MISMATCH)}, found "
                f"{self.length_mismatch!r}"
            )

    @property
    def builder_options(self) -> dict[str, object]:
        """Keyword arguments of :class:`~r3data.trace.TraceBuilder`."""
        return {
            "routes_field": self.routes_field,
            "ragged_fields": self.ragged_fields,
            "last_token_row": self.last_token_row,
        }


@options
class CollateOptions:
    """What a batch holds and how it is filled.

    ``fields``: the stitched fields (each gets ``<field>_valid``). ``pin_memory`` allocates
    page-locked buffers. ``workers`` bounds the threads that fill a batch (default: the
    cgroup-aware CPU count). ``buffer_pool`` recycles batch buffers across loaders (one
    loader per epoch, say); by default each loader has its own.
    """

    fields: tuple[str, ...] = (ROUTES_FIELD,)
    pin_memory: bool = False
    workers: int | None = None
    buffer_pool: BufferPool | None = None

    def __post_init__(self) -> None:
        fields = _names("fields", self.fields)
        if not fields:
            raise ConfigError("fields: expected at least one field name, found none")
        object.__setattr__(self, "fields", fields)
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory: expected a bool, found {self.pin_memory!r}")
        if self.workers is not None:
            checked_int("workers", self.workers, minimum=1)
        if self.buffer_pool is not None and not isinstance(self.buffer_pool, BufferPool):
            raise ConfigError(
                f"buffer_pool: expected a BufferPool, found {type(self.buffer_pool).__name__}"
            )
