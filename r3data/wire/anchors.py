"""Where a request's route rows sit in its token sequence: the one anchoring rule of r3data.

A request of ``prompt_len + completion_len`` tokens forwards all of them but the last sampled
token, which is never fed back, so route rows end at :func:`routes_end`,
``prompt_len + completion_len - 1`` (exclusive): vLLM, SGLang, prime-rl and SkyRL never send
a row for the last token. Rows are placed in one of two ways:

- start-anchored, what every producer does (vLLM's ``routed_experts_prompt_start``, SGLang's
  ``routed_experts_start_len``, prime-rl's envelope ``start``; 0 by default): the rows cover
  ``[start, start + rows)``;
- end-anchored, for rows known to be complete whose start is not stated: ``rows`` rows cover
  ``[routes_end - rows, routes_end)``.

A complete response is both, which is how a producer decoder checks the row count once it
knows the lengths (:func:`anchored_pos`). Per-completion-token fields (sampling masks,
logprobs) are not routes: their row i sits at ``prompt_len + i``.
"""

from __future__ import annotations

from r3data.errors import ConfigError, EngineRoutesError
from r3data.validate import nonnegative_int

__all__ = [
    "anchored_pos",
    "end_anchored_pos",
    "routes_end",
    "start_anchored_pos",
]


def routes_end(prompt_len: int, completion_len: int, *, last_token_row: bool = False) -> int:
    """One past the last position that has a route row: the last forwarded token, or the last
    token itself for an engine that also sends a row for it (``last_token_row``)."""
    tokens = prompt_len + completion_len
    return tokens if last_token_row else max(tokens - 1, 0)


def end_anchored_pos(
    prompt_len: int, completion_len: int, rows: int, *, what: str = "end-anchored routes"
) -> int:
    """First position of ``rows`` route rows ending at the last forwarded token;
    :class:`EngineRoutesError` when there are more rows than forwarded tokens."""
    prompt_len = nonnegative_int("prompt_len", prompt_len)
    completion_len = nonnegative_int("completion_len", completion_len)
    rows = nonnegative_int("rows", rows)
    end = routes_end(prompt_len, completion_len)
    if rows > end:
        raise EngineRoutesError(
            f"{what}: expected at most {end} route rows (prompt {prompt_len} + completion "
            f"{completion_len} - 1), found {rows}"
        )
    return end - rows


def start_anchored_pos(
    prompt_len: int,
    completion_len: int,
    rows: int,
    prompt_start: int | None = None,
    *,
    last_token_row: bool = False,
) -> int:
    """First position of ``rows`` route rows starting at ``prompt_start`` (vLLM's
    ``routed_experts_prompt_start``, SGLang's ``routed_experts_start_len``; None means 0).

    The rows may stop short of the last forwarded token (the trace handles the gap) but not
    pass it (:class:`EngineRoutesError`) unless ``last_token_row`` admits a row for the last
    token.
    """
    prompt_len = nonnegative_int("prompt_len", prompt_len)
    completion_len = nonnegative_int("completion_len", completion_len)
    rows = nonnegative_int("rows", rows)
    start = 0 if prompt_start is None else nonnegative_int("prompt_start", prompt_start)
    if start > prompt_len:
        raise ConfigError(
            f"prompt_start: expected an int in [0, {prompt_len}] (the prompt length), found {start}"
        )
    end = routes_end(prompt_len, completion_len, last_token_row=last_token_row)
    if start + rows > end:
        covered = "tokens" if last_token_row else "forwarded tokens"
        raise EngineRoutesError(
            f"start-anchored routes: {rows} rows from position {start} end at {start + rows}, "
            f"past the {end} {covered} of prompt {prompt_len} + completion {completion_len}"
        )
    return start


def anchored_pos(
    rows: int, prompt_len: int | None, completion_len: int | None, start: int | None, *, what: str
) -> int | None:
    """First position of the ``rows`` route rows a producer returned for a whole request.

    With both lengths known the rows end at the last forwarded token, and a ``start`` the
    producer states must agree (:class:`EngineRoutesError` otherwise: rows are missing or
    extra). Without them, ``start`` alone places the rows (None: nothing does).
    """
    if prompt_len is None or completion_len is None:
        return start
    if start is None:
        return end_anchored_pos(prompt_len, completion_len, rows, what=what)
    end = routes_end(prompt_len, completion_len)
    if start > end:
        raise EngineRoutesError(
            f"{what}: expected a start at most {end} (prompt {prompt_len} + completion "
            f"{completion_len} - 1), found start {start}"
        )
    if start + rows != end:
        raise EngineRoutesError(
            f"{what}: expected {end - start} route rows (prompt {prompt_len} + completion "
            f"{completion_len} - 1 - start {start}), found {rows}"
        )
    return start
