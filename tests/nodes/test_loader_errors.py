"""What the loader says when something is wrong: option errors, errors from its threads, silent
cases made loud, DataLoader misuse, logging."""

from __future__ import annotations

import itertools
import logging
import traceback
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import r3data
from r3data import loader
from r3data.errors import ConfigError, TraceError, UsageError
from r3data.nodes import (
    CollateOptions,
    DataParallel,
    MicroBatches,
    RolloutDataset,
    ScreenOptions,
    Shuffle,
    TraceOptions,
)
from r3data.payload import PayloadWriter
from r3data.wire import InlineRows, pack_ndarray

LAYERS, TOPK = 2, 2
SETTINGS = list(itertools.product([1, 2], [0, 1, 2]))  # (fill workers, prefetch)


def sample(sample_id, n, *, covered=None, rows=None):
    covered = n if covered is None else covered
    rows = np.full((covered - 1, LAYERS, TOPK), 3, np.uint8) if rows is None else rows
    request = {"prompt_len": 1, "completion_len": covered - 1}
    request["sources"] = [InlineRows("routed_experts", rows, 0)]
    return {"id": sample_id, "token_ids": np.arange(n), "requests": [request]}


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "named", "hint"),
    [
        (lambda: loader([], batch_size=1, num_expert=8), "'num_expert'", "num_experts"),
        (lambda: loader([], batch_size=1, workers=2), "'workers'", None),
        (lambda: TraceOptions(on_gaps="raise"), "'on_gaps'", "on_gap"),
        (
            lambda: loader([], batch_size=1, trace={"palceholder": "x"}),
            "'palceholder'",
            "placeholder",
        ),
        (lambda: ScreenOptions(zero_row="keep"), "'zero_row'", "zero_rows"),
        (lambda: CollateOptions(feilds=("a",)), "'feilds'", "fields"),
        (lambda: MicroBatches(max_token=3), "'max_token'", "max_tokens"),
        (lambda: DataParallel(rnak=0), "'rnak'", "rank"),
        (lambda: Shuffle(sed=1), "'sed'", "seed"),
        (lambda: RolloutDataset([], batch_size=1, worker=2), "'worker'", None),
    ],
)
def test_a_misspelt_option_is_a_config_error_naming_it_and_the_valid_ones(make, named, hint):
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    assert named in message
    assert "valid options:" in message
    if hint:
        assert f"did you mean {hint!r}" in message


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TraceOptions(on_gap="skip"), "on_gap: expected"),
        (lambda: TraceOptions(placeholder="zeros"), "placeholder: expected"),
        (lambda: TraceOptions(length_mismatch="loud"), "length_mismatch: expected"),
        (lambda: TraceOptions(topk=0), "topk: expected an int >= 1"),
        (lambda: CollateOptions(fields=()), "at least one field"),
        (lambda: CollateOptions(workers=0), "workers: expected an int >= 1"),
        (lambda: loader([], batch_size=1, trace=3), "expected a TraceOptions"),
        (lambda: loader([], batch_size=1, num_experts=0), "num_experts: expected an int >= 1"),
        (
            lambda: loader([], batch_size=1, num_experts=8, screen=ScreenOptions(num_experts=16)),
            "give it once",
        ),
    ],
)
def test_bad_option_values_are_refused_before_any_sample_is_read(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_num_experts_is_the_loaders_own_argument():
    wide = np.full((4, LAYERS, TOPK), 7, np.int32)
    (batch,) = loader([sample("a", 5, rows=wide)], batch_size=1, num_experts=16)
    assert batch["routed_experts"].dtype == torch.uint8
    with pytest.raises(
        TraceError, match=r"sample 'a' \(index 0\): .*expected expert ids in \[0, 4\)"
    ):
        list(loader([sample("a", 5, rows=wide)], batch_size=1, num_experts=4))


# --- errors from the loader's threads ------------------------------------------------------


@pytest.mark.parametrize(("workers", "prefetch"), SETTINGS)
def test_a_thread_error_arrives_as_its_class_on_one_line_with_the_worker_traceback(
    tmp_path, workers, prefetch
):
    rows = np.ones((3, LAYERS, TOPK), np.uint8)
    rows[1, 0, 1] = 9  # no expert 9 in a model of 8
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows})
    wrong = {"id": "wrong", "token_ids": np.arange(4)}
    wrong["requests"] = [{"prompt_len": 2, "completion_len": 2, "sources": [segment.to_dict()]}]
    options = {"batch_size": 1, "payload_root": tmp_path, "prefetch": prefetch, "num_experts": 8}
    with pytest.raises(TraceError) as info:
        list(loader([sample("ok", 4), wrong], collate={"workers": workers}, **options))
    message = str(info.value)
    assert "\n" not in message
    assert message.count("wrong") == 1
    assert message.startswith("sample 'wrong' (index 1): field 'routed_experts'")
    assert message.endswith("expected expert ids in [0, 8), found 9 at position 1 (layer 0)")
    cause = info.value.__cause__
    assert type(cause) is TraceError  # the original, raised on a loader thread
    frames = [f.filename for f in traceback.extract_tb(cause.__traceback__)]
    assert any(name.endswith("fill.py") for name in frames)


@pytest.mark.parametrize(("workers", "prefetch"), SETTINGS)
def test_a_bad_sample_is_named_once(workers, prefetch):
    bad = {"id": "bad", "token_ids": ["x"], "requests": []}
    with pytest.raises(TraceError) as info:
        list(loader([bad], batch_size=1, prefetch=prefetch, collate={"workers": workers}))
    assert str(info.value) == (
        "sample 'bad' (index 0): token_ids must be integers, found dtype <U1"
    )
    short = sample("short", 4)
    short["requests"][0]["sources"][0] = InlineRows(
        "routed_experts", np.ones((5, 2, 2), np.uint8), 0
    )
    with pytest.raises(TraceError) as info:
        list(loader([short], batch_size=1, prefetch=prefetch, collate={"workers": workers}))
    message = str(info.value)
    assert message.startswith("sample 'short' (index 0): field 'routed_experts': rows cover")
    assert message.count("short") == 1


@dataclass
class Exploding:
    """A sample whose token ids cannot be read: the reading calls ``sys.exit``."""

    id: str
    error: type[BaseException]

    @property
    def token_ids(self):
        raise self.error(3)


class ExplodingSource:
    def __init__(self, samples, at, error):
        self.samples, self.at, self.error = samples, at, error

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        if i == self.at:
            raise self.error
        return self.samples[i]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "prefetch"), SETTINGS)
@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
def test_system_exit_or_interrupt_in_a_sample_or_a_source_never_hangs(workers, prefetch, error):
    options = {"batch_size": 1, "prefetch": prefetch, "collate": {"workers": workers}}
    with pytest.raises(error):
        list(loader([sample("a", 4), Exploding("x", error), sample("b", 4)], **options))
    with pytest.raises(error):
        list(loader(ExplodingSource([sample(str(i), 4) for i in range(4)], 2, error), **options))


def test_a_step_that_cannot_be_planned_arrives_as_a_config_error():
    samples = [sample("a", 4), sample("long", 40)]
    with pytest.raises(ConfigError, match="has 40 tokens, more than one micro-batch may hold"):
        list(loader(samples, batch_size=2, micro_batches=MicroBatches(max_tokens=30)))


# --- silent cases made loud ----------------------------------------------------------------


def test_token_ids_longer_or_shorter_than_the_trace_warn_by_default_and_raise_when_strict(caplog):
    longer, shorter = sample("long", 12, covered=4), sample("short", 3, covered=6)
    with caplog.at_level(logging.WARNING, logger="r3data"):
        (batch,) = loader([longer, shorter], batch_size=2)
    found = [r.getMessage() for r in caplog.records]
    assert "sample 'long' (index 0): 12 token_ids, but its requests cover 4 tokens" in found[0]
    assert "sample 'short' (index 1): 3 token_ids, but its requests cover 6 tokens" in found[1]
    assert found == batch.metadata["warnings"]
    with pytest.raises(TraceError, match=r"sample 'long' \(index 0\): 12 token_ids, .*'raise'"):
        list(loader([longer], batch_size=1, trace=TraceOptions(length_mismatch="raise")))
    caplog.clear()
    (batch,) = loader([longer], batch_size=1, trace={"length_mismatch": "ignore"})
    assert not caplog.records
    assert not batch.metadata["warnings"]


def test_engine_bugs_are_logged_once_per_sample_with_counts(caplog):
    rows = np.full((9, LAYERS, TOPK), 3, np.uint8)
    rows[[1, 2, 6]] = 0  # three all-zero rows in one sample
    envelope = pack_ndarray(rows, start=0)
    source = {"producer": "prime-rl", "response": {"choices": [{"routed_experts": envelope}]}}
    buggy = {"id": "buggy", "token_ids": np.arange(10)}
    buggy["requests"] = [{"prompt_len": 5, "completion_len": 5, "sources": [source]}]
    with caplog.at_level(logging.WARNING, logger="r3data"):
        (batch,) = loader([buggy, sample("fine", 10)], batch_size=2)
    (record,) = caplog.records
    assert "sample 'buggy'" in record.getMessage()
    assert "3 route rows" in record.getMessage()
    assert batch.metadata["stats"].rows_missing == 3


def test_the_package_logs_through_a_null_handler_per_module_logger():
    package = logging.getLogger("r3data")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    from r3data.nodes import collate, stitcher

    assert stitcher.logger.name == "r3data.nodes.stitcher"
    assert collate.logger.name == "r3data.nodes.collate"
    assert r3data.R3DataError is not None


# --- DataLoader conventions ----------------------------------------------------------------


def test_dataloader_misuse_gets_one_line_saying_what_to_write():
    dataset = RolloutDataset([sample("a", 4), sample("b", 4)], batch_size=1)
    assert [b["sample_id"] for b in DataLoader(dataset, batch_size=None)] == [["a"], ["b"]]
    with pytest.raises(UsageError) as info:
        list(DataLoader(dataset, batch_size=1))
    assert str(info.value).startswith("RolloutDataset yields collated micro-batches")
    assert "batch_size=None" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError) as info:
        DistributedSampler(dataset, num_replicas=2, rank=0)
    assert "data_parallel=DataParallel(rank=..., size=...)" in str(info.value)
    assert isinstance(info.value, TypeError)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        list(DataLoader(dataset, batch_size=None, num_workers=1))
    assert str(info.value).startswith("RolloutDataset runs its own threads")
    assert "\n" not in str(info.value)
    assert "Traceback" in "".join(getattr(info.value, "__notes__", []))  # the worker's, kept
