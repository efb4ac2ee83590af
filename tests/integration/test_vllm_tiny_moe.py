"""The tiny Qwen3-MoE checkpoint the vLLM suite serves: deterministic, cached by its recipe."""

from __future__ import annotations

import copy

import pytest
import tiny_moe
from safetensors.numpy import load_file
from transformers import AutoTokenizer
from vllm_fixtures import hf_tiny_moe_fixture, tiny_moe_checkpoint_fixture  # noqa: F401


def test_a_cached_checkpoint_is_not_rebuilt(tiny_moe_checkpoint, monkeypatch):
    def refuse(out):
        raise AssertionError(f"rebuilt {out}")

    monkeypatch.setattr(tiny_moe, "build", refuse)
    assert tiny_moe.cached_checkpoint(tiny_moe_checkpoint.parent) == tiny_moe_checkpoint
    assert tiny_moe_checkpoint.name == f"tiny-moe-{tiny_moe.recipe_key()}"


def test_the_key_follows_the_recipe(monkeypatch):
    key = tiny_moe.recipe_key()
    changed = copy.deepcopy(tiny_moe.RECIPE)
    changed["config"]["num_experts"] = 16
    monkeypatch.setattr(tiny_moe, "RECIPE", changed)
    assert tiny_moe.recipe_key() != key


def test_a_rebuild_gives_the_same_weights(tiny_moe_checkpoint, tmp_path):
    tiny_moe.build(tmp_path)
    cached = load_file(tiny_moe_checkpoint / "model.safetensors")
    rebuilt = load_file(tmp_path / "model.safetensors")
    assert sorted(rebuilt) == sorted(cached)
    for name, array in cached.items():
        assert (rebuilt[name] == array).all(), name


def test_an_interrupted_build_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    def fail_halfway(out):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(tiny_moe, "build", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        tiny_moe.cached_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_plain_words_round_trip_and_the_chat_template_extends_each_turn(tiny_moe_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_checkpoint)
    assert len(tokenizer) == tiny_moe.VOCAB_SIZE
    text = " ".join(tiny_moe.PLAIN_WORDS)
    ids = tokenizer(text)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids(w) for w in tiny_moe.PLAIN_WORDS]
    assert tokenizer.decode(ids) == text
    turn = [{"role": "user", "content": "hello world"}]
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"]
    reply = tokenizer("the red fox")["input_ids"]
    turn += [{"role": "assistant", "content": " the red fox"}, {"role": "user", "content": "why"}]
    later = tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"]
    assert later[: len(prompt) + len(reply)] == prompt + reply


def test_the_dense_layer_has_no_router(hf_tiny_moe):
    routes = tiny_moe.router_topk(hf_tiny_moe, list(range(6, 40)))
    assert routes.shape == (34, tiny_moe.NUM_LAYERS, tiny_moe.TOPK)
    assert not routes[:, list(tiny_moe.DENSE_LAYERS)].any()
    moe = routes[:, list(tiny_moe.MOE_LAYERS)]
    assert moe.min() >= 0
    assert moe.max() < tiny_moe.NUM_EXPERTS
    assert len({tuple(row) for row in moe.reshape(34, -1)}) > 10  # routing differs by token
