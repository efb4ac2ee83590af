"""The loader's attack campaign, bounded and seeded: batches of good samples with one fault
planted among them (a malformed sample, a lying body, a truncated, corrupt, missing or
escaping file, an exception raised by the sample itself), under several worker and prefetch
settings. Every run either yields the good samples' exact rows or raises a typed error naming
the faulty sample; none hangs, none mixes rows between samples."""

from __future__ import annotations

import os

import numpy as np
import pytest

from r3data import loader
from r3data.errors import R3DataError
from r3data.payload import PayloadWriter
from r3data.wire import pack_ndarray

LAYERS, TOPK, EXPERTS = 3, 2, 16
CASES = 78  # six of each fault kind, the settings cycling under them
pytestmark = pytest.mark.timeout(120)


class Exploding(dict):
    """A sample whose lookups fail partway (a user's own object gone wrong)."""

    def __getitem__(self, key):
        if key == "requests":
            raise RuntimeError("the sample's store went away")
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default  # noqa: SIM401 - through __getitem__


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return (np.argsort(rng.random((n, LAYERS, EXPERTS)), -1)[..., :TOPK] + 1).astype(np.uint8)


def _good(rng, i: int, writer: PayloadWriter) -> tuple[dict, np.ndarray]:
    n = int(rng.integers(3, 12))
    rows = _rows(rng, n - 1)
    if i % 2:
        source = writer.write(0, {"routed_experts": rows})[0].to_dict()
    else:
        envelope = pack_ndarray(rows, start=0)
        source = {"producer": "prime-rl", "response": {"choices": [{"routed_experts": envelope}]}}
    request = {"prompt_len": n // 2, "completion_len": n - n // 2, "sources": [source]}
    return {"id": f"s{i}", "token_ids": np.arange(n), "requests": [request]}, rows


FAULTS = (
    "no_token_ids", "float_tokens", "bad_request", "bad_source", "lying_shape", "bad_base64",
    "missing_file", "truncated_file", "corrupt_file", "escaping_handle", "bad_dtype",
    "exploding", "too_many_rows",
)  # fmt: skip


def _plant(kind: str, sample: dict, root: str, rng) -> dict:
    request = sample["requests"][0]
    source = request["sources"][0]
    if kind == "no_token_ids":
        del sample["token_ids"]
    elif kind == "float_tokens":
        sample["token_ids"] = np.linspace(0, 1, len(sample["token_ids"]))
    elif kind == "bad_request":
        sample["requests"] = [{"prompt_len": -1, "completion_len": 2, "sources": []}]
    elif kind == "bad_source":
        request["sources"] = [42]
    elif kind == "lying_shape" and "producer" in source:
        source["response"]["choices"][0]["routed_experts"]["shape"][0] += 1
    elif kind == "bad_base64" and "producer" in source:
        envelope = source["response"]["choices"][0]["routed_experts"]
        envelope["data"] = "!" + envelope["data"][1:]
    elif kind in ("missing_file", "truncated_file", "corrupt_file") and "file" in source:
        path = os.path.join(root, source["file"])
        if kind == "missing_file":
            os.remove(path)
        elif kind == "truncated_file":
            with open(path, "r+b") as f:
                f.truncate(source["offset"] + 1)
        else:
            with open(path, "r+b") as f:
                f.seek(source["offset"])
                f.write(b"\xff")
    elif kind == "escaping_handle" and "file" in source:
        source["file"] = "../" * 6 + "etc/passwd"
    elif kind == "bad_dtype" and "file" in source:
        source["dtype"] = "object"
    elif kind == "exploding":
        return Exploding(sample)
    elif kind == "too_many_rows":
        request["completion_len"] -= 2
    else:  # the fault does not apply to this kind of source: plant a sure one
        del sample["token_ids"]
    return sample


def test_one_planted_fault_is_named_or_harmless_never_a_hang_or_a_mixup(tmp_path):
    rng = np.random.default_rng(16)
    settings = [(1, 0), (2, 0), (2, 2), (3, 1)]
    failures = 0
    for case in range(CASES):
        root = str(tmp_path / f"c{case}")
        writer = PayloadWriter(root)
        samples, rows = zip(*(_good(rng, i, writer) for i in range(5)), strict=True)
        samples = list(samples)
        bad = int(rng.integers(0, 5))
        kind = FAULTS[case % len(FAULTS)]
        samples[bad] = _plant(kind, samples[bad], root, rng)
        workers, prefetch = settings[case % len(settings)]
        options = {"batch_size": 2, "payload_root": root, "collate": {"workers": workers}}
        options["prefetch"] = prefetch
        seen = []
        error = None
        try:
            for batch in loader(samples, **options):
                for b, sample_id in enumerate(batch["sample_id"]):
                    i = int(sample_id[1:])
                    got = batch["routed_experts"][b].numpy()
                    assert np.array_equal(got[: len(rows[i])], rows[i]), (kind, sample_id)
                    seen.append(i)
        except (R3DataError, RuntimeError) as exc:
            error = exc
        if error is None:  # the fault was harmless: every sample came out, rows exact
            assert sorted(seen) == list(range(5)), kind
            continue
        failures += 1
        assert bad not in seen
        if isinstance(error, R3DataError):  # named: the faulty sample, never another one
            assert f"sample 's{bad}'" in str(error), (kind, str(error))
            assert all(f"'s{i}'" not in str(error) for i in range(5) if i != bad)
        else:  # the sample's own exception, as it raised it
            assert kind == "exploding", (kind, error)
            assert "went away" in str(error)
    assert failures >= CASES * 3 // 4
