"""r3data.loader end to end: inline and by-handle samples against a naive reference."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from r3data import TensorBatch, loader
from r3data.errors import (
    ConfigError,
    PayloadNotFoundError,
    PayloadReadError,
    TraceError,
    TraceGapError,
)
from r3data.nodes import CollateOptions, RolloutDataset, ScreenOptions, StitchRollout, TraceOptions
from r3data.payload import PayloadRetention, PayloadWriter, shift
from r3data.trace import TraceBuilder
from r3data.wire import InlineRows, pack_ndarray

LAYERS, TOPK, EXPERTS = 3, 2, 40


def make_rollouts(rng: np.random.Generator, count: int, root=None, version: int = 0):
    """Multi-turn samples with engine routes; half inline, half by handle when ``root`` is given.

    Returns the samples and, per sample, the naive expected routes ``[sample_len, L, K]``
    and valid mask.
    """
    writer = PayloadWriter(root) if root is not None else None
    samples, expected = [], []
    for i in range(count):
        turns = int(rng.integers(1, 4))
        tokens = 0
        requests = []
        engine = {}
        for _ in range(turns):
            prompt_len = tokens + int(rng.integers(1, 6))
            completion_len = int(rng.integers(1, 8))
            forwarded = prompt_len + completion_len - 1
            # a later turn sends the full prefix, or only the rows from its first new one
            # (routed_experts_prompt_start): the earlier turns' rows must then survive
            first = 0 if tokens == 0 or rng.random() < 0.5 else tokens - 1
            rows = rng.integers(0, EXPERTS, (forwarded - first, LAYERS, TOPK)).astype(np.uint8)
            for p in range(first, forwarded):
                engine[p] = rows[p - first]
            if writer is not None and i % 2:
                source = writer.write(version, {"routed_experts": rows}, pos=first)[0].to_dict()
            elif i % 3 == 0:
                envelope = pack_ndarray(rows, start=first)
                source = {
                    "producer": "prime-rl",
                    "response": {"choices": [{"routed_experts": envelope}]},
                }
            else:
                source = InlineRows("routed_experts", rows, first)
            requests.append(
                {"prompt_len": prompt_len, "completion_len": completion_len, "sources": [source]}
            )
            tokens = prompt_len + completion_len
        token_ids = rng.integers(0, 1000, tokens)
        samples.append(
            {
                "id": f"s{i}",
                "token_ids": token_ids,
                "loss_mask": rng.integers(0, 2, tokens).astype(bool),
                "logprobs": rng.normal(size=tokens).astype(np.float32),
                "requests": requests,
            }
        )
        routes = np.stack([engine.get(p, engine[tokens - 2]) for p in range(tokens)])
        valid = np.array([p in engine for p in range(tokens)])
        expected.append((routes, valid))
    return samples, expected


def files_of(batch: TensorBatch) -> set[str]:
    """Every payload file of a batch (its metadata lists each sample's)."""
    return {f for files in batch.metadata["files"] for f in files}


def check_batch(batch: TensorBatch, samples, expected, first: int) -> None:
    for b in range(batch.batch_size):
        sample = samples[first + b]
        routes, valid = expected[first + b]
        assert batch["sample_id"][b] == sample["id"]
        assert np.array_equal(batch["routed_experts"][b].numpy(), routes)
        assert np.array_equal(batch["routed_experts_valid"][b].numpy(), valid)
        assert np.array_equal(batch["token_ids"][b].numpy(), sample["token_ids"])
        assert np.array_equal(batch["loss_mask"][b].numpy(), sample["loss_mask"])
        assert np.array_equal(batch["logprobs"][b].numpy(), sample["logprobs"])


@pytest.mark.parametrize("workers", [1, 3])
def test_inline_and_by_handle_batches_equal_the_naive_reference(tmp_path, workers):
    samples, expected = make_rollouts(np.random.default_rng(0), 11, root=tmp_path)
    batches = list(
        loader(
            samples,
            batch_size=4,
            payload_root=tmp_path,
            collate=CollateOptions(workers=workers),
            prefetch=2,
        )
    )
    assert [b.batch_size for b in batches] == [4, 4, 3]
    for k, batch in enumerate(batches):
        check_batch(batch, samples, expected, 4 * k)
        assert batch["routed_experts"].dtype == torch.uint8
        assert batch["routed_experts"].values.nbytes == sum(
            expected[4 * k + b][0].nbytes for b in range(batch.batch_size)
        )
    used = set().union(*(files_of(b) for b in batches))
    on_disk = {
        os.path.relpath(os.path.join(d, f), tmp_path)
        for d, _, names in os.walk(tmp_path)
        for f in names
    }
    assert used == on_disk
    assert sum(b.metadata["stats"].samples for b in batches) == 11


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_at_every_batch_boundary_yields_exactly_the_rest(tmp_path, prefetch):
    samples, _ = make_rollouts(np.random.default_rng(1), 9, root=tmp_path)
    options = {
        "batch_size": 2,
        "payload_root": tmp_path,
        "collate": CollateOptions(workers=2),
        "prefetch": prefetch,
    }
    full = list(loader(samples, **options))
    for cut in range(len(full) + 1):
        first = loader(samples, **options)
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = first.state_dict()
        resumed = loader(samples, **options)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(rest) == len(full) - cut
        for got, want in zip(rest, full[cut:], strict=True):
            assert got == want


def test_a_missing_file_names_the_sample_and_does_not_hang(tmp_path):
    samples, _ = make_rollouts(np.random.default_rng(2), 6, root=tmp_path)
    victim = samples[5]  # by handle, and last of its batch: the error must not blame s3
    segment = victim["requests"][-1]["sources"][0]
    os.remove(tmp_path / segment["file"])
    batches = iter(
        loader(samples, batch_size=3, payload_root=tmp_path, collate=CollateOptions(workers=2))
    )
    next(batches)
    with pytest.raises(PayloadNotFoundError, match=r"sample 's5' \(index 5\)") as info:
        next(batches)
    assert isinstance(info.value, PayloadReadError)
    assert segment["file"] in str(info.value)


def test_a_bad_sample_names_itself():
    rows = np.zeros((1, LAYERS, TOPK), np.uint8) + 1
    request = {
        "prompt_len": 1,
        "completion_len": 1,
        "sources": [InlineRows("routed_experts", rows, 0)],
    }
    samples = [
        {"id": "ok", "token_ids": [1, 2], "requests": [request]},
        {"id": "bad", "requests": []},
    ]
    with pytest.raises(TraceError, match=r"sample 'bad' \(index 1\).*token_ids"):
        list(loader(samples, batch_size=2, collate=CollateOptions(workers=1)))


def test_retention_keeps_each_file_until_the_step_of_its_batch(tmp_path):
    samples, _ = make_rollouts(np.random.default_rng(3), 8, root=tmp_path, version=0)
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=4, fresh=False)
    try:
        it = iter(loader(samples, batch_size=4, payload_root=tmp_path, retention=retention))
        first = next(it)
        assert first.metadata["step"] == 0
        retention.on_policy_update(0)
        retention.wait()
        for f in files_of(first):
            assert not (tmp_path / f).exists()
        second = next(it)
        assert second.metadata["step"] == 1
        assert all((tmp_path / f).exists() for f in files_of(second))
        retention.on_policy_update(1)
        retention.wait()
        assert not any((tmp_path / f).exists() for f in files_of(second))
    finally:
        retention.close()


def test_stitching_claims_a_samples_files_for_the_step_of_its_batch(tmp_path):
    (segment,) = PayloadWriter(tmp_path).write(
        0, {"routed_experts": np.ones((3, LAYERS, TOPK), np.uint8)}
    )
    sample = {
        "id": "late",
        "token_ids": np.arange(4),
        "requests": [{"prompt_len": 2, "completion_len": 2, "sources": [segment]}],
    }
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=4, fresh=False)
    try:
        stitch = StitchRollout(("routed_experts",), retention=retention)
        stitch((9, sample), 12)  # sample 9 is in a micro-batch of step 12
        for step in (10, 11):
            retention.on_policy_update(step)
            retention.wait()
            assert (tmp_path / segment.file).exists()
        retention.on_policy_update(12)
        retention.wait()
        assert not (tmp_path / segment.file).exists()
    finally:
        retention.close()


@pytest.mark.parametrize(("workers", "prefetch"), [(2, 2), (3, 1)])
def test_a_file_shared_across_batches_outlives_the_first_update(tmp_path, workers, prefetch):
    """A GRPO group written to one file, split across batches 0 and 1: the update after step 0
    must not delete what batch 1 still has to read."""
    rows = np.random.default_rng(7).integers(0, EXPERTS, (6, 5, LAYERS, TOPK)).astype(np.uint8)
    (segment,) = PayloadWriter(tmp_path).write(
        0, {"routed_experts": rows.reshape(30, LAYERS, TOPK)}
    )
    samples = [
        {
            "id": f"g{i}",
            "token_ids": np.arange(6),
            "requests": [
                {
                    "prompt_len": 3,
                    "completion_len": 3,
                    "sources": [shift([segment.clipped(5 * i, 5 * i + 5)], -5 * i)[0]],
                }
            ],
        }
        for i in range(6)
    ]
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=4, fresh=False)
    try:
        options = {"batch_size": 4, "payload_root": tmp_path, "collate": {"workers": workers}}
        it = iter(loader(samples, retention=retention, prefetch=prefetch, **options))
        first = next(it)
        assert set(first.metadata["files"]) == {(segment.file,)}
        retention.on_policy_update(0)
        retention.wait()
        second = next(it)  # reads the shared file after the update of step 0
        assert second["sample_id"] == ["g4", "g5"]
        for b, i in enumerate((4, 5)):
            assert np.array_equal(second["routed_experts"][b][:5].numpy(), rows[i])
        retention.on_policy_update(1)
        retention.wait()
        assert not (tmp_path / segment.file).exists()
    finally:
        retention.close()


def test_dataloader_and_stateful_dataloader_adapters(tmp_path):
    samples, expected = make_rollouts(np.random.default_rng(4), 7, root=tmp_path)
    options = {"batch_size": 3, "payload_root": tmp_path, "collate": CollateOptions(workers=2)}
    plain = list(DataLoader(RolloutDataset(samples, **options), batch_size=None))
    assert [b.batch_size for b in plain] == [3, 3, 1]
    check_batch(plain[1], samples, expected, 3)
    assert "stats" in plain[0].metadata
    stateful = StatefulDataLoader(RolloutDataset(samples, **options), batch_size=None)
    it = iter(stateful)
    next(it)
    state = stateful.state_dict()
    resumed = StatefulDataLoader(RolloutDataset(samples, **options), batch_size=None)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b["sample_id"] for b in rest] == [["s3", "s4", "s5"], ["s6"]]


def test_sampling_masks_and_widened_routes_collate(tmp_path):
    """Masks inline (prime-rl CSR) and by handle (ragged file rows) stay ragged and pad to the
    batch's widest set with -1 on request; a uint16 turn widens a uint8 trace; valid marks
    engine rows only."""
    from r3data.wire import pack_csr

    writer = PayloadWriter(tmp_path)
    rng = np.random.default_rng(5)
    narrow = rng.integers(0, 200, (4, LAYERS, TOPK)).astype(np.uint8)
    wide = rng.integers(300, 900, (7, LAYERS, TOPK)).astype(np.uint16)
    mask_rows = [rng.choice(50, size=int(w), replace=False).astype(np.int32) for w in (2, 5, 1)]
    by_handle = writer.write(
        1,
        {"routed_experts": narrow, "sampling_mask": mask_rows},
        pos={"routed_experts": 0, "sampling_mask": 2},
    )
    ids = np.concatenate(mask_rows[:2])
    inline_mask = {
        "producer": "prime-rl-sampling-mask",
        "response": {"choices": [{"sampling_mask": pack_csr(ids, np.array([2, 5], np.int32))}]},
    }
    samples = [
        {
            "id": "handle",
            "token_ids": np.arange(5),
            "requests": [
                {"prompt_len": 2, "completion_len": 3, "sources": [s.to_dict() for s in by_handle]}
            ],
        },
        {
            "id": "two-turns",
            "token_ids": np.arange(9),
            "requests": [
                {
                    "prompt_len": 3,
                    "completion_len": 2,
                    "sources": [
                        InlineRows("routed_experts", narrow, 0),
                        InlineRows("sampling_mask", np.array([[7], [8]], np.int32), 3),
                    ],
                },
                {
                    "prompt_len": 6,
                    "completion_len": 2,
                    "sources": [InlineRows("routed_experts", wide, 0), inline_mask],
                },
            ],
        },
    ]
    (batch,) = loader(
        samples,
        batch_size=2,
        payload_root=tmp_path,
        collate=CollateOptions(fields=("routed_experts", "sampling_mask"), workers=2),
    )
    routes = batch["routed_experts"]
    assert routes.dtype == torch.uint16
    assert np.array_equal(routes[0][:4].numpy(), narrow)
    assert np.array_equal(routes[0][4].numpy(), narrow[3])  # placeholder repeats the last row
    assert np.array_equal(routes[1][:7].numpy(), wide)
    assert batch["routed_experts_valid"][0].tolist() == [True] * 4 + [False]
    every_id = sum(len(r) for r in mask_rows) + 2 + ids.size  # ragged: each id stored once
    assert batch["sampling_mask"].values.numel() == every_id
    masks = batch["sampling_mask"].padded()  # padded to the batch's widest set, on request
    assert masks.row_shape == (5,)
    first = masks[0].numpy()
    assert (first[:2] == -1).all()
    for i, row in enumerate(mask_rows):
        assert sorted(first[2 + i][first[2 + i] >= 0]) == sorted(row)
    second = masks[1].numpy()
    assert sorted(second[6][second[6] >= 0]) == sorted(mask_rows[0])
    assert sorted(second[7][second[7] >= 0]) == sorted(mask_rows[1])
    assert second[3].tolist() == [7, -1, -1, -1, -1]
    assert batch["sampling_mask_valid"][1].tolist() == [False] * 3 + [True] * 2 + [False] + [
        True
    ] * 2 + [False]


def test_by_handle_expert_ids_are_checked_once_read(tmp_path):
    rows = np.full((3, LAYERS, TOPK), 5, np.uint8)
    rows[1, 2, 1] = EXPERTS + 7
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows})
    samples = [
        {
            "id": "too-many-experts",
            "token_ids": np.arange(4),
            "requests": [{"prompt_len": 2, "completion_len": 2, "sources": [segment.to_dict()]}],
        }
    ]
    options = {"batch_size": 1, "payload_root": tmp_path, "collate": CollateOptions(workers=1)}
    with pytest.raises(TraceError, match=r"sample 'too-many-experts'.*found 47 at position 1"):
        list(loader(samples, num_experts=EXPERTS, **options))
    (batch,) = loader(samples, num_experts=64, **options)
    assert int(batch["routed_experts"].values.max()) == EXPERTS + 7


@pytest.mark.parametrize("by_handle", [True, False])
def test_zero_rows_are_missing_rows_by_handle_and_inline_alike(tmp_path, by_handle):
    """One screen: a route row zero in every layer (an engine bug) is a missing row, a gap under
    ``on_gap``, whether it arrived in a file or inline."""
    rows = np.full((6, LAYERS, TOPK), 3, np.uint8)
    rows[2] = 0  # the engine bug: a row zero in every layer
    if by_handle:
        (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows})
        source = segment.to_dict()
    else:
        envelope = pack_ndarray(rows, start=0)
        source = {"producer": "prime-rl", "response": {"choices": [{"routed_experts": envelope}]}}
    samples = [
        {
            "id": "zeros",
            "token_ids": np.arange(7),
            "requests": [{"prompt_len": 3, "completion_len": 4, "sources": [source]}],
        }
    ]
    options = {"batch_size": 1, "payload_root": tmp_path, "collate": CollateOptions(workers=1)}
    (batch,) = loader(samples, **options)  # on_gap="drop_routes": every row a placeholder
    routes = batch["routed_experts"][0].numpy()
    assert (routes == np.arange(TOPK)).all()  # distinct experts, never zeros
    assert not batch["routed_experts_valid"][0].any()
    stats = batch.metadata["stats"]
    assert (stats.gaps, stats.rows_missing, stats.rows_dropped) == (1, 1, 5)
    with pytest.raises(TraceGapError, match=r"sample 'zeros'.*1 route rows at positions \[2, 3\)"):
        list(loader(samples, trace=TraceOptions(on_gap="raise"), **options))
    (none,) = loader(samples, trace={"on_gap": "drop_sample"}, **options)
    assert (none.batch_size, none.metadata["dropped"]) == (0, ["zeros"])
    with pytest.raises(TraceError, match=r"sample 'zeros'.*positions \[2\] are zero"):
        list(loader(samples, screen=ScreenOptions(zero_rows="raise"), **options))
    (kept,) = loader(samples, screen={"zero_rows": "keep"}, **options)
    assert not kept["routed_experts"][0][2].any()
    assert kept["routed_experts_valid"][0].tolist() == [True] * 6 + [False]


def test_num_experts_stores_routes_in_the_compact_dtype():
    """SGLang sends int32 ids; with num_experts known the batch holds them as uint8."""
    rng = np.random.default_rng(6)
    wide = rng.integers(0, EXPERTS, (4, LAYERS, TOPK)).astype(np.int32)
    response = {"meta_info": {"routed_experts": wide.tobytes(), "routed_experts_start_len": 0}}
    source = {"producer": "sglang", "response": response, "num_layers": LAYERS, "topk": TOPK}
    sample = {
        "id": "sglang",
        "token_ids": np.arange(5),
        "requests": [{"prompt_len": 2, "completion_len": 3, "sources": [source]}],
    }
    (plain,) = loader([sample], batch_size=1, collate=CollateOptions(workers=1))
    assert plain["routed_experts"].dtype == torch.int32
    (compact,) = loader(
        [sample], batch_size=1, collate=CollateOptions(workers=1), num_experts=EXPERTS
    )
    assert compact["routed_experts"].dtype == torch.uint8
    assert np.array_equal(compact["routed_experts"][0][:4].numpy(), wide)


def test_a_multi_choice_response_needs_a_choice():
    rows = np.ones((3, LAYERS, TOPK), np.uint8)
    response = {"choices": [{"routed_experts": pack_ndarray(rows, start=0)}] * 2}
    request = {"prompt_len": 2, "completion_len": 2}
    sample = {"id": "two", "token_ids": np.arange(4), "requests": [request]}
    request["sources"] = [{"producer": "prime-rl", "response": response}]
    with pytest.raises(TraceError, match="gave 2 choices for one request"):
        list(loader([sample], batch_size=1, collate=CollateOptions(workers=1)))
    request["sources"] = [{"producer": "prime-rl", "response": response, "choice": 1}]
    (batch,) = loader([sample], batch_size=1, collate=CollateOptions(workers=1))
    assert batch["routed_experts"].total_rows == 4


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"id": "a", "token_ids": ["x"], "requests": []}, "token_ids must be integers"),
        ({"id": "f", "token_ids": [1.9, 2.0], "requests": []}, "token_ids must be integers"),
        (
            {"id": "m", "token_ids": [1, 2], "loss_mask": [0, 3], "requests": []},
            "loss_mask must be booleans or 0/1, found dtype int64 with values up to 3",
        ),
        ({"id": "b", "token_ids": [1], "requests": [{"prompt_len": 1}]}, "request 0: expected"),
        ({"id": "c", "token_ids": [1], "requests": [3]}, "request 0: expected"),
    ],
)
def test_malformed_samples_raise_typed_errors(sample, message):
    with pytest.raises(TraceError, match=message):
        list(loader([sample], batch_size=1, collate=CollateOptions(workers=1)))


def test_a_sample_with_no_routes_at_all_is_dropped_unless_gaps_raise(caplog):
    rows = np.ones((3, LAYERS, TOPK), np.uint8)
    good = {
        "id": "good",
        "token_ids": np.arange(4),
        "requests": [
            {
                "prompt_len": 2,
                "completion_len": 2,
                "sources": [InlineRows("routed_experts", rows, 0)],
            }
        ],
    }
    bare = {
        "id": "bare",
        "token_ids": np.arange(4),
        "requests": [{"prompt_len": 2, "completion_len": 2}],
    }
    (batch,) = loader([good, bare], batch_size=2, collate=CollateOptions(workers=1))
    assert batch["sample_id"] == ["good"]
    assert batch.metadata["dropped"] == ["bare"]
    assert "no rows of ['routed_experts'] in any request" in caplog.text
    with pytest.raises(TraceGapError, match=r"sample 'bare'.*no rows for positions \[0, 3\)"):
        list(
            loader(
                [good, bare],
                batch_size=2,
                collate=CollateOptions(workers=1),
                trace=TraceOptions(on_gap="raise"),
            )
        )


def test_a_ready_trace_with_ids_too_wide_for_the_compact_dtype_is_refused():
    """num_experts narrows routes; ids a ready trace never checked must not wrap (300 -> 44)."""
    ids = np.full((3, LAYERS, TOPK), 300, np.int32)
    builder = TraceBuilder("ready")
    builder.add_request(2, 2, [InlineRows("routed_experts", ids, 0)])
    sample = {"id": "ready", "token_ids": np.arange(4), "trace": builder}
    options = {"batch_size": 1, "collate": CollateOptions(workers=1), "num_experts": EXPERTS}
    with pytest.raises(
        TraceError, match=r"sample 'ready'.*expected expert ids in \[0, 40\), found 300"
    ):
        list(loader([sample], **options))
    ids[:] = 7
    (batch,) = loader([sample], **options)
    assert batch["routed_experts"].dtype == torch.uint8
    assert (batch["routed_experts"][0][:3] == 7).all()


def test_retention_without_the_step_of_a_sample_is_a_config_error(tmp_path):
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": np.ones((3, 2, 2), np.uint8)})
    sample = {"id": "s", "token_ids": np.arange(4)}
    sample["requests"] = [{"prompt_len": 2, "completion_len": 2, "sources": [segment]}]
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=1, fresh=False)
    with pytest.raises(ConfigError, match=r"sample 's' \(index 0\): .*needs the step"):
        StitchRollout(("routed_experts",), retention=retention)((0, sample))


def test_worker_processes_are_refused(tmp_path):
    samples, _ = make_rollouts(np.random.default_rng(8), 2, root=tmp_path)
    dataset = RolloutDataset(samples, batch_size=2, payload_root=tmp_path)
    with pytest.raises(ConfigError, match="num_workers=0"):
        list(DataLoader(dataset, batch_size=None, num_workers=1))
