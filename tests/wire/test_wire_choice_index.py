"""Non-stream OpenAI-style bodies (vLLM, prime-rl, SkyRL): ``choice=k`` is the choice whose
``choices[].index`` is ``k``, wherever the body lists it; indices that name no choice once
each (duplicates, bools, negatives, gaps, on some choices only) are refused."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from producer_bodies import common, primerl_bodies, skyrl_bodies, vllm_bodies

from r3data import loader
from r3data.errors import ConfigError, WireFormatError
from r3data.wire.producers import FORMATS, EngineRequest, Lengths

LAYERS, TOPK, PROMPT = 4, 2, 5
engine_rows = functools.partial(common.engine_rows, layers=LAYERS, topk=TOPK)
SETTINGS = settings(max_examples=40, deadline=None)


def decode(name: str, body, lengths=(None, None), **options):
    entry = FORMATS[name]
    return entry.decode(body, entry.make_options(options), Lengths(*lengths))


def samples(completions: list[int]) -> list[tuple[list[int], np.ndarray]]:
    """One sample per completion length: its token ids and its engine rows (seeded apart)."""
    return [
        (list(range(100, 100 + length)), engine_rows(PROMPT + length, seed=seed + 1))
        for seed, length in enumerate(completions)
    ]


def vllm_body(drawn: list[tuple[list[int], np.ndarray]]) -> bytes:
    prompt = vllm_bodies.Prompt(
        list(range(PROMPT)), [vllm_bodies.Sample(ids, rows) for ids, rows in drawn]
    )
    return vllm_bodies.completion_body([prompt], num_experts=8)


def primerl_body(drawn: list[tuple[list[int], np.ndarray]]) -> bytes:
    choices = [
        {"token_ids": ids, "routed_experts": primerl_bodies.routed_experts_envelope(rows)}
        for ids, rows in drawn
    ]
    return primerl_bodies.generate_body(choices, prompt_len=PROMPT)


def skyrl_body(drawn: list[tuple[list[int], np.ndarray]]) -> bytes:
    """SkyRL's body has one choice and no ``index``: each sample's choice, given its index."""
    choices = [
        {"index": index, **orjson.loads(skyrl_bodies.generate_body(ids, rows))["choices"][0]}
        for index, (ids, rows) in enumerate(drawn)
    ]
    return common.orjson_body({"choices": choices})


BODIES = {"vllm": vllm_body, "prime-rl": primerl_body, "skyrl": skyrl_body}


def relisted(body: bytes, order: list[int], **changes: object) -> bytes:
    """``body`` with its choices listed in ``order`` (positions of the original list), and
    ``changes`` (``at{position}=index``, ``None`` deleting the key) applied to the
    relisted choices' ``index``."""
    doc = orjson.loads(body)
    doc["choices"] = [doc["choices"][position] for position in order]
    for position, index in changes.items():
        choice = doc["choices"][int(position.removeprefix("at"))]
        if index is None:
            del choice["index"]
        else:
            choice["index"] = index
    return orjson.dumps(doc)


def assert_routes(choice, ids: list[int], rows: np.ndarray, index: int) -> None:
    (source,) = choice.sources
    assert choice.choice == index
    assert source.meta["choice"] == index
    assert source.meta["completion_len"] == len(ids)
    np.testing.assert_array_equal(source.array, rows)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_choices_listed_out_of_order_are_selected_by_their_index(name):
    drawn = samples([3, 2, 4])
    body = relisted(BODIES[name](drawn), [2, 0, 1])  # index 2 first
    lengths = (PROMPT, None)
    for k, (ids, rows) in enumerate(drawn):
        (choice,) = decode(name, body, lengths, choice=k)
        assert_routes(choice, ids, rows, k)
    every = decode(name, body, lengths)
    assert [c.choice for c in every] == [0, 1, 2]  # in index order, not list order
    for k, (choice, (ids, rows)) in enumerate(zip(every, drawn, strict=True)):
        assert_routes(choice, ids, rows, k)
    with pytest.raises(ConfigError, match=r"choice 3 out of range; response has 3"):
        decode(name, body, lengths, choice=3)


@pytest.mark.parametrize("name", ["vllm", "prime-rl"])
def test_loader_gives_a_sample_the_routes_of_the_choice_it_names(name):
    """The review's reproducer: index 1 listed first, the sample asks for choice 0."""
    requests = [
        EngineRequest(list(range(PROMPT)), list(range(4)), rows, num_experts=16)
        for rows in np.random.default_rng(0).integers(1, 16, (2, PROMPT + 3, 3, 2), np.uint8)
    ]
    first, second = (orjson.loads(FORMATS[name].encode(r)) for r in requests)
    choices = [{**second["choices"][0], "index": 1}, first["choices"][0]]
    body = orjson.dumps({**first, "choices": choices})
    source = {"producer": name, "response": body, "choice": 0}
    sample = {
        "id": "s0",
        "token_ids": np.arange(PROMPT + 4),
        "requests": [{"prompt_len": PROMPT, "completion_len": 4, "sources": [source]}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (batch,) = list(loader([sample], batch_size=1, num_experts=16))
    got = batch["routed_experts"].values.numpy()[: PROMPT + 3]
    np.testing.assert_array_equal(got, requests[0].routes)


@pytest.mark.parametrize("name", sorted(BODIES))
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"at2": 0}, r"expected distinct choice indices, found index 0 in choices\[0\] and "),
        ({"at1": True}, r"choices\[1\]\.index: expected an int >= 0, found True"),
        ({"at0": False}, r"choices\[0\]\.index: expected an int >= 0, found False"),
        ({"at1": -1}, r"choices\[1\]\.index: expected an int >= 0, found -1"),
        ({"at0": 1.0}, r"choices\[0\]\.index: expected an int >= 0, found 1\.0"),
        ({"at0": "0"}, r"choices\[0\]\.index: expected an int >= 0, found '0'"),
        ({"at1": None}, r"'index' in every choice or in none, found one in choices\[0\] but none "),
        ({"at0": None}, r"'index' in every choice or in none, found one in choices\[1\] but none "),
        ({"at2": 7}, r"expected choice indices 0\.\.n-1, found \[0, 1, 7\]"),
    ],
)
def test_indices_that_do_not_name_each_choice_once_are_refused(name, changes, match):
    body = relisted(BODIES[name](samples([3, 2, 4])), [0, 1, 2], **changes)
    for choice in (None, 0, 2):  # whichever choice is asked for: the body is malformed
        with pytest.raises(WireFormatError, match=rf"{name} response.*{match}"):
            decode(name, body, (PROMPT, None), choice=choice)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_a_choice_that_is_not_an_object_is_refused_whichever_is_asked_for(name):
    doc = orjson.loads(BODIES[name](samples([3, 2])))
    doc["choices"][1] = [1]
    with pytest.raises(WireFormatError, match=r"choices\[1\]: expected an object, found list"):
        decode(name, orjson.dumps(doc), (PROMPT, None), choice=0)


def test_skyrl_choices_without_index_keep_their_positions():
    drawn = samples([3, 2, 4])
    body = relisted(skyrl_body(drawn), [0, 1, 2], at0=None, at1=None, at2=None)
    assert all("index" not in c for c in orjson.loads(body)["choices"])
    for k, (ids, rows) in enumerate(drawn):
        (choice,) = decode("skyrl", body, (PROMPT, None), choice=k)
        assert_routes(choice, ids, rows, k)
    assert [c.choice for c in decode("skyrl", body, (PROMPT, None))] == [0, 1, 2]


@SETTINGS
@given(
    name=st.sampled_from(sorted(BODIES)),
    data=st.data(),
    completions=st.lists(st.integers(1, 6), min_size=1, max_size=5, unique=True),
)
def test_choice_k_decodes_the_choice_whose_index_is_k_in_any_listing(name, data, completions):
    """Distinct lengths and distinct routes: any mix-up of two choices shows."""
    drawn = samples(completions)
    order = data.draw(st.permutations(range(len(drawn))), label="order")
    body = relisted(BODIES[name](drawn), order)
    k = data.draw(st.integers(0, len(drawn) - 1), label="k")
    (choice,) = decode(name, body, (PROMPT, len(drawn[k][0])), choice=k)
    assert_routes(choice, *drawn[k], k)
    parsed = FORMATS[name].parse(body)  # a spliced body selects alike
    (again,) = decode(name, parsed, (PROMPT, None), choice=k)
    assert_routes(again, *drawn[k], k)
