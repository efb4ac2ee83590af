"""Retention through the loader: every file a sample reads is claimed for the last step that
reads it, whatever form names it (a segment dict, a ``PayloadSegment``, a producer's
by-handle response, a ready trace), and nothing is deleted before that step's update."""

from __future__ import annotations

import json

import numpy as np
import pytest
from source_kinds import Again

from r3data import loader
from r3data.errors import PayloadHandleError, TraceError
from r3data.nodes import MicroBatches
from r3data.payload import PayloadRetention, PayloadRoot, PayloadWriter

LAYERS, TOPK, EXPERTS = 2, 2, 16
PROMPT, COMPLETION = 3, 2
ROWS = PROMPT + COMPLETION - 1


def primerl_by_handle(segment: dict, file_key: str = '"file"') -> dict:
    """A prime-rl ``/inference/v1/generate`` response whose one choice names ``segment``, its
    ``file`` key spelled ``file_key`` (JSON reads every spelling alike)."""
    choice = {"index": 0, "token_ids": [7] * COMPLETION, "payload": [segment]}
    body = json.dumps({"request_id": "r", "choices": [choice]}).replace('"file"', file_key)
    return {"producer": "prime-rl", "response": body.encode()}


def request(source) -> dict:
    return {"prompt_len": PROMPT, "completion_len": COMPLETION, "sources": [source]}


def shared_file_samples(root, **spelling):
    """Sample 0 names the file by a segment dict, sample 1 the same rows by a prime-rl
    response; one more file of sample 1's alone, read by a prime-rl response too (both
    responses spelled as ``spelling`` asks, :func:`primerl_by_handle`)."""
    writer = PayloadWriter(root)
    rng = np.random.default_rng(0)
    rows = rng.integers(1, EXPERTS, (ROWS, LAYERS, TOPK)).astype(np.uint8)
    (shared,) = writer.write(0, {"routed_experts": rows})
    own_rows = rng.integers(1, EXPERTS, (ROWS, LAYERS, TOPK)).astype(np.uint8)
    (own,) = writer.write(0, {"routed_experts": own_rows})
    tokens = np.arange(PROMPT + COMPLETION)
    samples = [
        {"id": "a", "token_ids": tokens, "requests": [request(shared.to_dict())]},
        {
            "id": "b",
            "token_ids": tokens,
            "requests": [
                request(primerl_by_handle(own.to_dict(), **spelling)),
                request(primerl_by_handle(shared.to_dict(), **spelling)),
            ],
        },
    ]
    return samples, {"a": rows, "b": rows}, shared.file, own.file


@pytest.mark.parametrize(
    "spelling",
    [
        {},
        {"file_key": r'"fil\u0065"'},  # an escape the parser reads as "file"
        {"file_key": r'"\u0066\u0069\u006C\u0065"'},
    ],
    ids=["plain", "escaped", "all-escaped"],
)
def test_a_file_a_producer_response_names_is_claimed_for_its_step(tmp_path, spelling):
    samples, expected, shared, own = shared_file_samples(tmp_path, **spelling)
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=8, fresh=False)
    batches = loader(samples, batch_size=1, retention=retention, prefetch=0)
    for batch in batches:
        (sample_id,) = batch["sample_id"]
        got = batch["routed_experts"][0].numpy()
        np.testing.assert_array_equal(got[:ROWS], expected[sample_id])
        assert batch["routed_experts_valid"][0].numpy()[:ROWS].all()
        step = batch.metadata["step"]
        retention.on_policy_update(step)
        retention.wait()
        assert (tmp_path / shared).exists() == (step < 1)  # sample b, step 1, reads it last
    assert not (tmp_path / own).exists()  # released by its step, not left to the backstop
    assert retention.metrics().files_deleted == 2
    retention.close()


def test_micro_batches_of_one_step_share_the_claim(tmp_path):
    """Both samples in one step, in different micro-batches: the file stays until the update
    after the step's last micro-batch."""
    samples, expected, shared, own = shared_file_samples(tmp_path)
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=8, fresh=False)
    batches = loader(
        samples,
        batch_size=2,
        micro_batches=MicroBatches(size=1),
        retention=retention,
        prefetch=1,
    )
    seen = []
    for batch in batches:
        (sample_id,) = batch["sample_id"]
        np.testing.assert_array_equal(
            batch["routed_experts"][0].numpy()[:ROWS], expected[sample_id]
        )
        seen.append(sample_id)
        assert (tmp_path / shared).exists()
        assert (tmp_path / own).exists()
    assert sorted(seen) == ["a", "b"]
    retention.on_policy_update(0)
    retention.wait()
    assert not (tmp_path / shared).exists()
    assert not (tmp_path / own).exists()
    retention.close()


def test_requests_that_cannot_be_read_twice_are_refused_under_retention(tmp_path):
    """The retention scan reads every sample before it is stitched: requests (or sources) in
    a generator would be used up by it, or their files missed and deleted early."""
    samples, _, _, _ = shared_file_samples(tmp_path)
    samples[1] = {**samples[1], "requests": iter(samples[1]["requests"])}
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=8, fresh=False)
    with pytest.raises(
        TraceError,
        match=r"sample 'b' \(index 1\): requests: expected a list or tuple .*found list_iterator",
    ):
        next(iter(loader(samples, batch_size=1, retention=retention, prefetch=0)))
    samples[1] = {**samples[1], "requests": [{**request(None), "sources": iter([])}]}
    with pytest.raises(TraceError, match=r"a request's sources: expected a list or tuple"):
        next(iter(loader(samples, batch_size=1, retention=retention, prefetch=0)))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_file_a_stream_shares_across_steps_stays_for_the_later_step(tmp_path, prefetch):
    """Sample a (step 0) and sample b (step 1) read one file: released at step 0's update, it
    must stay for b, which the loader has not seen then; the backstop removes it (version 0,
    one step off policy) at step 1's update, with b's own file."""
    samples, expected, shared, own = shared_file_samples(tmp_path)
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=1, fresh=False)
    batches = loader(Again(samples), batch_size=1, retention=retention, prefetch=prefetch)
    for batch in batches:
        (sample_id,) = batch["sample_id"]
        np.testing.assert_array_equal(
            batch["routed_experts"][0].numpy()[:ROWS], expected[sample_id]
        )
        step = batch.metadata["step"]
        retention.on_policy_update(step)
        retention.wait()
        assert (tmp_path / shared).exists() == (step < 1)
        assert (tmp_path / own).exists() == (step < 1)
    assert retention.metrics().files_deleted == 2
    retention.close()


def test_with_a_retention_no_file_is_read_through_a_symlink(tmp_path):
    """A symlink inside the root gives a file a second name: a claim on it would not keep the
    file under its first, which an earlier step's release deletes. The loader's reader follows
    none when it has a retention; without one, the link is read."""
    rows = np.random.default_rng(1).integers(1, EXPERTS, (ROWS, LAYERS, TOPK)).astype(np.uint8)
    (segment,) = PayloadWriter(tmp_path).write(0, {"routed_experts": rows})
    (tmp_path / "v0" / "alias.bin").symlink_to((tmp_path / segment.file).name)
    tokens = np.arange(PROMPT + COMPLETION)
    samples = [
        {"id": "a", "token_ids": tokens, "requests": [request(segment.to_dict())]},
        {
            "id": "b",
            "token_ids": tokens,
            "requests": [request({**segment.to_dict(), "file": "v0/alias.bin"})],
        },
    ]
    for batch in loader(samples, batch_size=1, payload_root=str(tmp_path), prefetch=0):
        np.testing.assert_array_equal(batch["routed_experts"][0].numpy()[:ROWS], rows)
    strict = PayloadRoot(str(tmp_path), follow_symlinks=False)  # a root that says so is kept
    with pytest.raises(PayloadHandleError, match="leads through a symlink"):
        list(loader(samples, batch_size=1, payload_root=strict, prefetch=0))
    retention = PayloadRetention(str(tmp_path), max_off_policy_steps=8, fresh=False)
    batches = iter(loader(samples, batch_size=1, retention=retention, prefetch=0))
    first = next(batches)
    np.testing.assert_array_equal(first["routed_experts"][0].numpy()[:ROWS], rows)
    retention.on_policy_update(0)
    retention.wait()
    with pytest.raises(PayloadHandleError, match=r"sample 'b'.*leads through a symlink"):
        next(batches)
    retention.close()
