"""Where a request's rows sit in the token sequence.

Request j forwards ``prompt_len + completion_len - 1`` tokens: the last sampled token is never
fed back, so it has no route row. Routes therefore end at position
``prompt_len + completion_len - 1`` (exclusive). Producers say where they start in two ways:
prime-rl anchors rows at that end, vLLM at ``routed_experts_prompt_start`` (0 by default).
Per-completion-token fields (sampling masks, logprobs) have row i at ``prompt_len + i``.
"""

from __future__ import annotations

import numpy as np

from r3data.errors import TraceError

__all__ = ["end_anchored_pos", "start_anchored_pos"]


def nonnegative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0, else :class:`TraceError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise TraceError(f"{name}: expected an int >= 0, found {value!r}")
    return int(value)


def _check_lengths(prompt_len: int, completion_len: int, rows: int) -> None:
    nonnegative_int("prompt_len", prompt_len)
    nonnegative_int("completion_len", completion_len)
    nonnegative_int("rows", rows)


def end_anchored_pos(prompt_len: int, completion_len: int, rows: int) -> int:
    """First position of ``rows`` route rows that end at the last forwarded token (prime-rl)."""
    _check_lengths(prompt_len, completion_len, rows)
    forwarded = prompt_len + completion_len - 1
    if rows > max(forwarded, 0):
        raise TraceError(
            f"end-anchored routes: expected at most {max(forwarded, 0)} rows for "
            f"prompt_len {prompt_len} + completion_len {completion_len}, found {rows}"
        )
    return forwarded - rows


def start_anchored_pos(
    prompt_len: int, completion_len: int, rows: int, prompt_start: int | None = None
) -> int:
    """First position of ``rows`` route rows starting at ``prompt_start`` (vLLM's
    ``routed_experts_prompt_start``; None means 0). An engine may also send a row for the
    last token; more rows than tokens is a :class:`TraceError`."""
    _check_lengths(prompt_len, completion_len, rows)
    start = (
        0 if prompt_start is None else nonnegative_int("routed_experts_prompt_start", prompt_start)
    )
    if start > prompt_len:
        raise TraceError(
            f"routed_experts_prompt_start: expected an int in [0, {prompt_len}], found "
            f"{prompt_start!r}"
        )
    tokens = prompt_len + completion_len
    if start + rows > tokens:
        raise TraceError(
            f"start-anchored routes: {rows} rows from position {start} end at {start + rows}, "
            f"past the {tokens} tokens of prompt_len {prompt_len} + completion_len "
            f"{completion_len}"
        )
    return start
