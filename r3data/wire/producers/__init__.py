"""The producer registry: every response format r3data reads, one module per producer format.

Each module of this package that defines ``FORMAT`` (a
:class:`~r3data.wire.producers.base.ProducerFormat`) is a registry entry: its name, how to
recognise its bodies (``r3data inspect``), how to decode them into rows with positions (the
loader) and how to synthesise them (:mod:`r3data.synth`). Adding a producer or a version is
adding one module; the loader, the CLI and synth read :data:`FORMATS` only.

The decoders' entry points (:func:`vllm_routes`, :func:`sglang_routes`, ...) are thin
wrappers over their format's :meth:`~r3data.wire.producers.base.ProducerFormat.decode`.
"""

from __future__ import annotations

import importlib
import mmap
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from r3data.errors import ConfigError, TraceError
from r3data.wire.producers.base import (
    ChoiceRows,
    EngineRequest,
    Lengths,
    ProducerFormat,
    SourceOptions,
)
from r3data.wire.producers.common import sniff
from r3data.wire.producers.primerl import primerl_routes
from r3data.wire.producers.primerl_sampling_mask import primerl_sampling_mask
from r3data.wire.producers.sglang import sglang_routes
from r3data.wire.producers.skyrl import skyrl_routes
from r3data.wire.producers.vllm import read_npy, vllm_routes

__all__ = [
    "FORMATS",
    "ChoiceRows",
    "EngineRequest",
    "Lengths",
    "ProducerFormat",
    "SourceOptions",
    "decode_source",
    "detect",
    "producer_format",
    "primerl_routes",
    "primerl_sampling_mask",
    "read_npy",
    "sglang_routes",
    "skyrl_routes",
    "vllm_routes",
]


def _discover() -> dict[str, ProducerFormat]:
    found: dict[str, ProducerFormat] = {}
    for info in pkgutil.iter_modules(__path__):
        entry = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FORMAT", None)
        if isinstance(entry, ProducerFormat):
            if entry.name in found:
                raise ImportError(f"two producer formats are named {entry.name!r}")
            found[entry.name] = entry
    return found


FORMATS: Mapping[str, ProducerFormat] = MappingProxyType(_discover())
"""Every producer format, by name."""

_SOURCE_KEYS = ("producer", "response")


def producer_format(name: object) -> ProducerFormat:
    """The format registered as ``name``."""
    found = FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"producer: expected one of {sorted(FORMATS)}, found {name!r:.60}")
    return found


def detect(raw: bytes | bytearray | memoryview | mmap.mmap) -> list[ProducerFormat]:
    """The formats whose bodies ``raw`` looks like, in registry order (several when versions
    send the same body)."""
    doc = sniff(raw)
    return [entry for entry in FORMATS.values() if entry.recognise(doc)]


def decode_source(source: Mapping[str, Any], *, prompt_len: int, completion_len: int) -> list[Any]:
    """The sources of a loader source ``{"producer": name, "response": body, **options}`` for
    one request of ``prompt_len + completion_len`` tokens: its one choice's rows (or
    handles). A misspelt option is a :class:`ConfigError` naming it and the valid ones."""
    entry = producer_format(source.get("producer"))
    options = entry.make_options(source, skip=_SOURCE_KEYS)
    choices = entry.decode(source.get("response"), options, Lengths(prompt_len, completion_len))
    if len(choices) != 1:
        raise TraceError(
            f"a {entry.name} response gave {len(choices)} choices for one request; name the "
            f"sample's one with 'choice'"
        )
    return list(choices[0].sources)
