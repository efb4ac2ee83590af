"""A fill on a filesystem that is not local-backed, when one of its reads fails or its caller is
interrupted while another read is stalled: the fill returns within about one call's timeout
(not each file's retries times it) and leaves no read retrying behind it, in a fixed-width
field and a ragged one alike."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "payload"))  # stalling

import numpy as np
import pytest
from stalling import SlowMemory

from r3data.errors import PayloadPermissionError
from r3data.nodes import fill as fill_module
from r3data.nodes import fill_field
from r3data.payload import PayloadReader, PayloadSegment, PayloadWriter
from r3data.trace import FieldInfo, StitchedField

TIMEOUT = 0.3
RETRIES = 4  # with the default backoff: about 3 s per stalled file if nothing stops it


class StalledReads(SlowMemory):
    """A private memory:// store: reads at ``(path, offset)`` in ``stalled`` hang until
    ``release``, those in ``refused`` are denied at once."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled: set[tuple[str, int]] = set()
        self.refused: set[tuple[str, int]] = set()

    def before_read(self, path: str, offset: int) -> None:
        if (path, offset) in self.refused:
            raise PermissionError(f"{path}: access denied")
        if (path, offset) in self.stalled:
            self.release.wait()


@pytest.fixture(name="store")
def store_fixture() -> Any:
    fs = StalledReads()
    yield fs
    fs.release.set()


def two_files(fs: StalledReads, ragged: bool) -> tuple[StitchedField, list[PayloadSegment]]:
    """A field of two segments, each in a file of its own, and where their rows start."""
    writer = PayloadWriter("/run", fs=fs)
    if ragged:
        rows = [np.arange(n, dtype=np.int32) for n in (3, 1, 2)]
        info = FieldInfo(np.dtype(np.int32), (), True)
    else:
        rows = np.arange(6 * 4, dtype=np.uint8).reshape(6, 2, 2)
        info = FieldInfo(np.dtype(np.uint8), (2, 2), False)
    segments = [writer.write(0, {"r": rows}, pos=pos)[0] for pos in (0, len(rows))]
    return StitchedField("r", tuple(segments), info, 2 * len(rows), None), segments


def values_at(s: PayloadSegment) -> tuple[str, int]:
    return f"/run/{s.file}", s.offset  # a ragged segment's values start at its offset


def fill(field: StitchedField, fs: StalledReads) -> Any:
    reader = PayloadReader("/run", fs=fs, timeout=TIMEOUT, retries=RETRIES, workers=2)
    return fill_field("r", [field], dtype=field.dtype, reader=reader, workers=2)


def assert_no_read_goes_on(fs: StalledReads) -> None:
    calls = len(fs.calls)
    time.sleep(TIMEOUT + 0.5)  # longer than a call and the backoff before the next
    assert fs.calls[calls:] == []


@pytest.fixture(autouse=True)
def lanes_for_small_fields(monkeypatch):
    monkeypatch.setattr(fill_module, "_LANE_BYTES", 1)  # two lanes even for a few rows


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_a_failed_read_stops_the_fills_other_reads(store, ragged):
    field, (stalled, refused) = two_files(store, ragged)
    store.stalled.add(values_at(stalled))
    store.refused.add(values_at(refused))
    start = time.monotonic()
    with pytest.raises(PayloadPermissionError, match=refused.file):  # not a read stopped for it
        fill(field, store)
    assert time.monotonic() - start < 2 * TIMEOUT + 0.4  # not the stalled file's retries
    assert_no_read_goes_on(store)


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="SIGINT needs it"
)
@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_an_interrupted_fill_returns_promptly_and_leaves_no_read_retrying(store, ragged):
    field, segments = two_files(store, ragged)
    store.stalled.update(values_at(s) for s in segments)
    main = threading.main_thread().ident
    interrupt = threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT))
    start = time.monotonic()
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        fill(field, store)
    assert time.monotonic() - start < 0.1 + TIMEOUT + 0.4
    assert_no_read_goes_on(store)
    store.release.set()
    store.stalled.clear()
    assert fill(field, store).values is not None  # the store answers again: the fill works
