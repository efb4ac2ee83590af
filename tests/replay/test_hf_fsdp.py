"""Replay under a real FSDP2 (``torch.distributed.fsdp.fully_shard``) on two gloo ranks: tiny
Qwen3-MoE (fp32, and bf16 mixed precision), DeepSeek-V3 (sigmoid, selection bias,
group-limited; the router and its MoE block sharded on their own), DBRX (the pick in the
block's ``route_tokens_to_experts``), Llama4 (dense scores out), GPT-OSS (selects on raw
logits) and torchtitan's MoE, each rank replaying its own share of a batch through
``r3data.loader``. What each rank does is in ``fsdp_worker``; here the parent checks what
the ranks report.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import fsdp_worker

sys.path.append(str(Path(__file__).resolve().parents[1] / "integration"))
from rank_helpers import spawn_ranks
from realparts import free_port, unavailable

DEADLINE_S = 240
CASES = list(fsdp_worker.CASES)
#: What the probe learns of each family's routers (method with the top-k, how the output
#: carries the pick, selects on raw logits), where it is not ``forward``, indices, no.
CONTRACTS = {
    "dbrx": ["route_tokens_to_experts", "indices", False],
    "llama4": ["forward", "scores", True],
    "gpt_oss": ["forward", "indices", True],
}


@pytest.fixture(scope="module")
def reports() -> dict[int, dict[str, dict]]:
    world = fsdp_worker.WORLD
    return spawn_ranks(fsdp_worker.run, world, (world, free_port()), DEADLINE_S)


@pytest.fixture(params=CASES)
def case(request, reports) -> tuple[dict, list[dict]]:
    """The case's spec and every rank's report of it."""
    by_rank = [reports[rank][request.param] for rank in sorted(reports)]
    if "unavailable" in by_rank[0]:
        unavailable(by_rank[0]["unavailable"])
    return fsdp_worker.CASES[request.param], by_rank


pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEADLINE_S + 60)]


def test_each_rank_replays_exactly_the_recorded_routes_of_its_own_samples(case):
    spec, ranks = case
    shares = [report["indices"] for report in ranks]
    assert sorted(i for share in shares for i in share) == list(range(6))  # disjoint, complete
    assert all(share for share in shares)
    for report in ranks:
        assert report["sharded"]  # the routers' weights are DTensors before the forward
        assert report["probed"]
        assert all(report["probed"])  # before the forward, on stand-ins of the sharded weights
        assert report["contract"] == report["unsharded_contract"]  # learnt the same
        contract = CONTRACTS.get(spec["family"], ["forward", "indices", False])
        assert report["contract"] == [contract] * len(report["contract"])
        assert report["loader_routes_exact"]
        assert report["replayed_exact"]
        assert report["router_grads_nonzero"]
        if spec["bf16"]:
            assert report["out_dtype"] == "torch.bfloat16"
            assert 0.0 < report["agreement"] <= 1.0  # bf16 scores may tie: not asserted 1.0
        else:
            assert report["agreement"] == report["batch_agreement"] == 1.0
            assert report["outputs_max_diff"] == 0.0  # the unsharded model, bit for bit
            assert report["grads_max_rel_diff"] < 1e-5  # up to the order of the reduction
        assert set(report["forwards"]) == {1}
        assert report["checkpointed"]  # every family here has activation checkpointing
        # with activation checkpointing every router ran once more in backward, replaying
        assert set(report["recomputes"]) == ({1} if report["checkpointed"] else {0})


def test_drifted_sharded_routers_route_otherwise_and_replay_as_recorded(case):
    _spec, ranks = case
    for report in ranks:
        assert report["drifted_own_exact"] < 1.0
        assert report["drifted_agreement"] < 1.0
        assert report["drifted_replayed_exact"]
        assert 0.0 < report["drifted_replace_rate"] < 1.0  # threshold=1.0 after the drift


def test_wrong_calls_raise_replay_errors_under_fsdp2(case):
    spec, ranks = case
    expected = {
        "expert_id_out_of_range": (r"expert id 8; .* from 8 experts", False),
        "other_topk": (r"pick top-2, the routes hold top-1", False),
        "other_input_ids": (r"holding other token ids than the ones the routes", True),
    }
    if spec["family"] != "torchtitan":
        expected["other_token_count"] = (r"routes \d+ tokens, the replayed routes hold \d+", True)
    for report in ranks:
        assert set(report["errors"]) == set(expected)
        for name, (message, ran) in expected.items():
            kind, text, model_ran = report["errors"][name]
            assert kind == "ReplayError", (name, kind, text)
            assert re.search(message, text), (name, text)
            assert model_ran is ran, name  # refused at the context's opening, or in the forward
        assert report["replays_after_errors"]
