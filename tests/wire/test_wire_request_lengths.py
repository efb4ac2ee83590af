"""A request's own lengths are checked where they are read (``Lengths``, ``EngineRequest``),
with the one integer check: a bool, a negative, a float or a count past int64 is the
request's error naming the field and the value. Before, ``prompt_len=True``, ``-1`` or
``completion_len=2**64`` reached the producers' agreement check and came out as "the response
has 5 prompt tokens, the request True; is this the request's response?", blaming the
response; and ``prompt_len=True`` passed where the body had one prompt token."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3data import loader
from r3data.errors import ConfigError, TraceError
from r3data.validate import INT64_MAX
from r3data.wire.producers import FORMATS, EngineRequest, Lengths, primerl_routes, skyrl_routes
from r3data.wire.producers.request import NO_LENGTHS

L, K, E = 3, 2, 16
BOUND = re.escape(f"expected an int in [0, {INT64_MAX}]")


def _request(prompt: int = 5, completion: int = 4, start: int = 0) -> EngineRequest:
    rows = np.random.default_rng(0).integers(1, E, (prompt + completion - 1 - start, L, K))
    return EngineRequest(
        list(range(prompt)), list(range(100, 100 + completion)), rows.astype(np.uint8), start
    )


OPTIONS = {"sglang": {"num_layers": L, "topk": K}}


def _load(body: bytes, producer: str, prompt_len, completion_len, tokens: int):
    source = {"producer": producer, "response": body, **OPTIONS.get(producer, {})}
    sample = {
        "id": "s0",
        "token_ids": np.arange(tokens),
        "requests": [
            {"prompt_len": prompt_len, "completion_len": completion_len, "sources": [source]}
        ],
    }
    return list(loader([sample], batch_size=1, num_experts=E))


@pytest.mark.parametrize(
    ("prompt_len", "completion_len", "named"),
    [
        (True, 4, "prompt_len: {BOUND}, found True"),
        (-1, 10, "prompt_len: {BOUND}, found -1"),
        (5, 2**64, "completion_len: {BOUND}, found 18446744073709551616"),
        (5.0, 4, "prompt_len: {BOUND}, found 5.0"),
        (5, np.bool_(False), "completion_len: {BOUND}, found np.False_"),
    ],
)
@pytest.mark.parametrize("producer", ["vllm", "prime-rl", "sglang"])
def test_the_loader_blames_the_request_not_the_response(
    producer, prompt_len, completion_len, named
):
    entry = FORMATS[producer]
    body = entry.encode(_request())
    with pytest.raises(TraceError) as caught:
        _load(body, producer, prompt_len, completion_len, tokens=9)
    message = str(caught.value)
    assert "is this the request" not in message
    assert caught.match(rf"^sample 's0' \(index 0\): {named.format(BOUND=BOUND)}$"), message


def test_prompt_len_true_is_no_one_token_prompt():
    """Before, ``True == 1`` agreed with a body of one prompt token and the sample loaded."""
    body = FORMATS["vllm"].encode(_request(prompt=1, completion=4))
    (batch,) = _load(body, "vllm", 1, 4, tokens=5)
    assert batch["routed_experts_valid"].values.tolist() == [True] * 4 + [False]
    with pytest.raises(TraceError, match=rf"prompt_len: {BOUND}, found True$"):
        _load(body, "vllm", True, 4, tokens=5)


def test_the_entry_points_check_the_lengths_they_are_given():
    body = FORMATS["prime-rl"].encode(_request())
    with pytest.raises(TraceError, match=rf"^prompt_len: {BOUND}, found True$"):
        primerl_routes(body, prompt_len=True)
    with pytest.raises(TraceError, match=rf"^completion_len: {BOUND}, found -3$"):
        primerl_routes(body, prompt_len=5, completion_len=-3)
    skyrl = FORMATS["skyrl"].encode(_request())
    with pytest.raises(TraceError, match=rf"^prompt_len: {BOUND}, found -1$"):
        skyrl_routes(skyrl, prompt_len=-1)
    (rows,) = primerl_routes(body, prompt_len=np.int64(5), completion_len=4)
    assert (rows.pos, rows.end) == (0, 8)


def test_lengths_keep_their_tuple_form():
    assert NO_LENGTHS == Lengths() == (None, None)
    lengths = Lengths(np.int64(5), completion_len=np.uint16(4))
    assert lengths == (5, 4)
    assert lengths.prompt_len == 5
    assert lengths.completion_len == 4
    assert type(lengths.prompt_len) is int
    assert type(lengths.completion_len) is int
    assert isinstance(lengths, tuple)
    assert lengths._fields == ("prompt_len", "completion_len")
    assert repr(lengths) == "Lengths(prompt_len=5, completion_len=4)"
    assert Lengths(0, INT64_MAX) == (0, INT64_MAX)
    with pytest.raises(TraceError, match=rf"^completion_len: {BOUND}, found {INT64_MAX + 1}$"):
        Lengths(0, INT64_MAX + 1)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 3).map(np.int64),
    st.floats(-3, 3),
    st.sampled_from(["5", np.bool_(True), np.float32(2)]),
)


def _is_count(value: object) -> bool:
    return value is None or (
        isinstance(value, int | np.integer)
        and not isinstance(value, bool)
        and 0 <= value <= INT64_MAX
    )


@settings(max_examples=300, deadline=None)
@given(_VALUES, _VALUES)
def test_lengths_are_accepted_iff_counts(prompt_len, completion_len):
    if _is_count(prompt_len) and _is_count(completion_len):
        lengths = Lengths(prompt_len, completion_len)
        assert lengths == (prompt_len, completion_len)
        return
    name, value = (
        ("prompt_len", prompt_len)
        if not _is_count(prompt_len)
        else ("completion_len", completion_len)
    )
    with pytest.raises(TraceError) as caught:
        Lengths(prompt_len, completion_len)
    assert str(caught.value) == f"{name}: expected an int in [0, {INT64_MAX}], found {value!r:.40}"


@pytest.mark.parametrize(
    ("start", "message"),
    [
        (True, "found True"),
        (-1, "found -1"),
        (6, "found 6"),
        (1.0, "found 1.0"),
    ],
)
def test_an_engine_request_start_is_a_position_in_its_prompt(start, message):
    rows = np.ones((8, L, K), np.uint8)
    with pytest.raises(
        ConfigError, match=rf"^EngineRequest.start: expected an int in \[0, 5\], {message}$"
    ):
        EngineRequest(list(range(5)), list(range(4)), rows, start)


def test_an_engine_request_start_of_numpy_is_an_int():
    request = _request(start=np.int64(2))
    assert request.start == 2
    assert type(request.start) is int
    assert request.routes.shape[0] == 5 + 4 - 1 - 2
