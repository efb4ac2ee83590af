"""Synthetic multi-turn rollouts with the ragged lengths and skewed expert load of real RL runs.

A :class:`SyntheticRouter` stands in for the inference engine's routers: per MoE layer a fixed
popularity over experts (a few hot experts, a long tail), so expert-load plots look like the
real thing and every rollout of one run agrees on which experts are hot. Each token gets
``topk`` distinct experts per MoE layer; dense layers are all-zero rows, as engines report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3data.errors import ConfigError
from r3data.synth.models import ModelShape
from r3data.validate import checked_int

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "Rollout",
    "SyntheticRouter",
    "draw_lengths",
    "synth_rollouts",
]

LENGTH_DISTRIBUTIONS = ("uniform", "mild", "typical_rl", "heavy_tail")

VOCAB_SIZE = 151_000
CHUNK_TOKENS = 4096
"""Routes are drawn this many tokens at a time, bounding the int32 scratch space."""


def draw_lengths(kind: str, count: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` sequence lengths in ``[1, max_len]``; the first is always ``max_len``.

    ``uniform``: anywhere in the range; ``mild``: the top quarter; ``typical_rl``: the shortest
    1/16 of the longest; ``heavy_tail``: Pareto, most short and a few near ``max_len``.
    """
    checked_int("count", count)
    checked_int("max_len", max_len, minimum=1)
    if kind == "uniform":
        lengths = rng.integers(1, max_len + 1, count)
    elif kind == "mild":
        lengths = rng.integers(max(1, 3 * max_len // 4), max_len + 1, count)
    elif kind == "typical_rl":
        lengths = rng.integers(max(1, max_len // 16), max_len + 1, count)
    elif kind == "heavy_tail":
        lengths = np.clip((rng.pareto(1.5, count) + 1) * max_len / 64, 1, max_len).astype(int)
    else:
        raise ConfigError(
            f"length distribution must be one of {list(LENGTH_DISTRIBUTIONS)}, found {kind!r}"
        )
    if count:
        lengths[0] = max_len
    return lengths.astype(np.int64)


class SyntheticRouter:
    """Draws route rows ``[tokens, num_layers, topk]`` for one model shape.

    Expert ``perm[l][q]`` is the q-th most popular of layer l, picked with probability
    proportional to ``(q + 1) ** -skew``; the other ``topk - 1`` experts of a row sit at fixed
    distinct offsets from it (one of a few patterns), so every row names distinct experts.
    """

    PATTERNS = 16

    def __init__(self, shape: ModelShape, *, seed: int = 0, skew: float = 0.8) -> None:
        if shape.topk > shape.num_experts:
            raise ConfigError(
                f"topk must be <= num_experts, found {shape.topk} > {shape.num_experts}"
            )
        rng = np.random.default_rng(checked_int("seed", seed))
        experts, moe = shape.num_experts, len(shape.moe_layer_ids)
        self.shape = shape
        weights = (np.arange(experts) + 1.0) ** -skew
        self.popularity = weights / weights.sum()
        self.perm = np.stack([rng.permutation(experts) for _ in range(moe)]).astype(
            shape.route_dtype
        )
        offsets = [
            np.concatenate(([0], rng.choice(np.arange(1, experts), shape.topk - 1, replace=False)))
            for _ in range(self.PATTERNS)
        ]
        self.offsets = np.stack(offsets).astype(np.int32)

    def route(self, tokens: int, rng: np.random.Generator) -> np.ndarray:
        """Route rows for ``tokens`` tokens (dense layers all zero)."""
        shape = self.shape
        out = np.zeros((tokens, *shape.row_shape), dtype=shape.route_dtype)
        moe = np.asarray(shape.moe_layer_ids)
        layer = np.arange(moe.size)[None, :, None]
        for lo in range(0, tokens, CHUNK_TOKENS):
            n = min(CHUNK_TOKENS, tokens - lo)
            base = rng.choice(shape.num_experts, size=(n, moe.size), p=self.popularity)
            pattern = rng.integers(0, self.PATTERNS, size=(n, moe.size))
            ranks = (base[..., None].astype(np.int32) + self.offsets[pattern]) % shape.num_experts
            out[lo : lo + n, shape.dense_layers :] = self.perm[layer, ranks]
        return out


@dataclass(frozen=True, eq=False)
class Rollout:
    """One multi-turn conversation and the routes the engine produced for it.

    Request j sends ``prompt_len`` tokens (every earlier turn included) and samples
    ``completion_len``; ``routes`` holds a row for every forwarded position ``[0, tokens - 1)``
    (the last sampled token is never forwarded).
    """

    rollout_id: str
    requests: tuple[tuple[int, int], ...]
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    routes: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def route_span(self, request: int) -> tuple[int, int]:
        """Positions ``[start, stop)`` of the rows request ``request`` returns when every turn
        asks only for rows it has not returned before (vLLM's ``routed_experts_prompt_start``)."""
        start = 0 if request == 0 else sum(self.requests[request - 1]) - 1
        return start, sum(self.requests[request]) - 1


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, max(lo, hi)))


def synth_rollouts(
    router: SyntheticRouter,
    count: int,
    *,
    seed: int = 0,
    max_turns: int = 3,
    max_len: int = 16384,
    prefix: str = "rollout",
) -> list[Rollout]:
    """``count`` rollouts of 1 to ``max_turns`` turns, at most ``max_len`` tokens each.

    Lengths are log-normal like agentic RL traffic: a system+user prompt (median 400 tokens),
    short user or tool turns (median 100) and completions (median 600) with a long tail, so
    rollout lengths in one batch differ by 10-60x.
    """
    checked_int("count", count)
    checked_int("max_turns", max_turns, minimum=1)
    checked_int("max_len", max_len, minimum=2)
    rng = np.random.default_rng(checked_int("seed", seed))
    rollouts = []
    for i in range(count):
        requests: list[tuple[int, int]] = []
        tokens = 0
        for turn in range(int(rng.integers(1, max_turns + 1))):
            if turn == 0:
                user = _lognormal(rng, 400, 0.8, 1, max_len // 4)
            else:
                user = _lognormal(rng, 100, 0.9, 1, 2048)
            completion = _lognormal(rng, 600, 1.0, 1, 8192)
            if tokens + user + completion > max_len:
                if turn:
                    break
                user = max(1, max_len // 4)
                completion = max_len - user
            requests.append((tokens + user, completion))
            tokens += user + completion
        loss_mask = np.zeros(tokens, dtype=bool)
        for prompt_len, completion_len in requests:
            loss_mask[prompt_len : prompt_len + completion_len] = True
        logprobs = np.where(loss_mask, -rng.exponential(0.7, tokens), 0.0).astype(np.float32)
        rollouts.append(
            Rollout(
                rollout_id=f"{prefix}-{i}",
                requests=tuple(requests),
                token_ids=rng.integers(0, VOCAB_SIZE, tokens),
                loss_mask=loss_mask,
                logprobs=logprobs,
                routes=router.route(tokens - 1, rng),
            )
        )
    return rollouts
