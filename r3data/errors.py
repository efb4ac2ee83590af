"""The r3data exception hierarchy.

Every bad input raises a subclass of :class:`R3DataError` whose message names what was
expected and what was found. Families subclass the builtin a caller would already catch
(``ValueError`` for malformed data, ``OSError`` for I/O), so existing ``except`` clauses
keep working.
"""

from __future__ import annotations


class R3DataError(Exception):
    """Base class of every error r3data raises on purpose."""


# --- packed tensors ------------------------------------------------------------------------


class PackedError(R3DataError, ValueError):
    """A ``PackedTensor`` or ``TensorBatch`` invariant does not hold."""


class PackedIndexError(PackedError, IndexError):
    """A segment index is out of range."""


# --- wire ----------------------------------------------------------------------------------


class WireFormatError(R3DataError, ValueError):
    """A body, envelope or producer response is malformed (deterministic: do not retry)."""


class EngineRoutesError(WireFormatError):
    """An engine returned routes that must not be replayed (e.g. all-zero rows)."""


# --- payload files -------------------------------------------------------------------------


class PayloadError(R3DataError):
    """Base of payload file errors."""


class PayloadHandleError(PayloadError, ValueError):
    """A payload handle is invalid or escapes its payload root."""


class PayloadReadError(PayloadError, OSError):
    """Reading payload bytes failed (short read after retries, I/O failure)."""


class PayloadNotFoundError(PayloadReadError, FileNotFoundError):
    """A payload file named by a handle does not exist."""


class PayloadPermissionError(PayloadReadError, PermissionError):
    """A payload file exists but may not be read."""


class PayloadChecksumError(PayloadReadError):
    """Payload bytes do not match the checksum recorded for them."""


class PayloadFormatError(PayloadError, ValueError):
    """A payload file header or table is malformed."""


class PayloadWriteError(PayloadError, OSError):
    """Writing or publishing a payload file failed."""


# --- segments and traces -------------------------------------------------------------------


class SegmentError(R3DataError, ValueError):
    """A segment is inconsistent (negative sizes, dtype or shape mismatch, bad ranges)."""


class TraceError(SegmentError):
    """A trace cannot be stitched as asked."""


class TraceGapError(TraceError):
    """Rows are missing inside a sample's span."""


# --- layout and replay ---------------------------------------------------------------------


class LayoutError(R3DataError, ValueError):
    """A parallel layout is invalid or unsupported."""


class ReplayError(R3DataError, RuntimeError):
    """Routes cannot be installed into, or were not consumed by, the model's routers."""


# --- configuration -------------------------------------------------------------------------


class ConfigError(R3DataError, ValueError):
    """A configuration value (environment variable, argument) is invalid."""


class UsageError(ConfigError, TypeError):
    """An object is used in a way it does not support (``len`` of a stream of batches, a
    sampler over them); a ``TypeError`` too, as Python's own would be."""


def with_message(exc: BaseException, message: str) -> BaseException:
    """An exception of ``exc``'s class with ``message`` (e.g. naming the sample first), chained
    to ``exc`` (whose traceback is where it happened), so callers keep catching what they
    caught. A class that takes no plain message (a ``KeyError`` quotes it, a ``SystemExit``
    would take it for its exit code, a constructor with other arguments) keeps ``exc`` itself,
    with ``message`` as a note."""
    new = None
    if isinstance(exc, Exception):
        try:
            new = type(exc)(message)
        except Exception:
            new = None
    if new is None or str(new) != message:
        if hasattr(exc, "add_note"):
            exc.add_note(message)
        return exc
    new.__cause__ = exc
    return new
