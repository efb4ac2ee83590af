"""The packed form (``hf_inputs(packed=True)``) is refused for the families that would mix its
samples (masks built without ``position_ids``; recurrent or convolution layers), and kept for
the ones that read its position restarts, whose packed forward equals the padded one sample
by sample."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import tiny_config, token_batch

from r3data.errors import ReplayError
from r3data.replay import hf_inputs, record, replay
from r3data.replay.hf import check_packed

MASK = "its decoder builds the attention mask without position_ids"
PADDED = r"use the padded form, hf_inputs\(batch\) \(packed=False\)"


def build(model_type: str, **fields) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` (``fields`` set on its tiny config)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    return model.eval()


def per_sample(model, inputs) -> list[torch.Tensor]:
    """The model's logits on ``inputs``, one ``[length, vocab]`` tensor per sample."""
    with torch.no_grad():
        logits = model(**inputs).logits
    return list(inputs.unpad(logits.reshape(-1, logits.shape[-1])))


REFUSED = {
    "gpt_oss": ("gpt_oss", {}, MASK),
    "afmoe": ("afmoe", {}, MASK),
    "granitemoehybrid": ("granitemoehybrid", {}, MASK),
    "jamba": ("jamba", {}, r"its linear_attention layers \(layers 0-1 of 2\)"),
    "qwen3_next": (
        "qwen3_next",
        {"layer_types": ["linear_attention", "full_attention"]},
        r"its linear_attention layers \(layer 0 of 2\)",
    ),
    "lfm2_moe": ("lfm2_moe", {}, r"its conv layers \(layer 0 of 2\)"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_packed_form_is_refused_where_it_would_mix_samples(family):
    model_type, fields, why = REFUSED[family]
    model = build(model_type, **fields)
    batch = token_batch()
    packed = hf_inputs(batch, packed=True)
    named = rf"in {type(model).__name__} \(model type '{model_type}'\): {why}.*{PADDED}"
    with pytest.raises(ReplayError, match=named):
        check_packed(model, packed)
    padded = hf_inputs(batch)
    with torch.no_grad(), record(model, padded) as rec:  # the padded form is not refused
        model(**padded)
    batch["routed_experts"] = rec.routes
    with pytest.raises(ReplayError, match=named), replay(model, batch, packed):
        pytest.fail("replay opened on packed inputs")
    with pytest.raises(ReplayError, match=named), record(model, packed):
        pytest.fail("record opened on packed inputs")
    with torch.no_grad(), replay(model, batch, padded):
        model(**padded)


@pytest.mark.parametrize("family", ["gpt_oss", "jamba"])
def test_the_refused_packed_forward_does_mix_samples(family):
    """Not the table's word alone: the packed forward of a refused family is wrong from the
    second sample on (the first sees nothing before it)."""
    model_type, fields, _ = REFUSED[family]
    model = build(model_type, **fields)
    batch = token_batch()
    padded = per_sample(model, hf_inputs(batch))
    packed = per_sample(model, hf_inputs(batch, packed=True))
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-5)
    for got, want in zip(packed[1:], padded[1:], strict=True):
        assert (got - want).abs().max() > 0.1


@pytest.mark.parametrize(
    ("model_type", "fields"),
    [
        ("qwen3_moe", {}),
        ("deepseek_v3", {}),
        ("qwen3_next", {"layer_types": ["full_attention", "full_attention"]}),
    ],
    ids=["qwen3_moe", "deepseek_v3", "qwen3_next_all_attention"],
)
@pytest.mark.parametrize("pad_multiple", [None, 4])
def test_packed_form_is_kept_where_its_restarts_are_read(model_type, fields, pad_multiple):
    """Packed logits equal padded logits for every sample, without replay and replaying the
    padded forward's routes (a hybrid family's config of attention layers only passes: the
    layer kinds come from the model's config)."""
    model = build(model_type, **fields)
    batch = token_batch()
    padded = hf_inputs(batch)
    packed = hf_inputs(batch, packed=True, pad_multiple=pad_multiple)
    check_packed(model, packed)
    with torch.no_grad(), record(model, padded) as rec:
        want = per_sample(model, padded)
    for got, expected in zip(per_sample(model, packed), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with replay(model, rec.routes, packed), record(model, packed) as used:
        replayed = per_sample(model, packed)
    assert torch.equal(used.routes.values, rec.routes.values)
    for got, expected in zip(replayed, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_hybrid_family_listing_no_layer_kinds_is_refused():
    """A config of a hybrid family that does not say which layers are recurrent (older
    transformers) is refused by its family."""
    model = build("lfm2_moe")
    model.config.layer_types = None
    with pytest.raises(ReplayError, match=r"'lfm2_moe'\): its family has recurrent or conv"):
        check_packed(model, hf_inputs(token_batch(), packed=True))


def test_padded_inputs_and_models_without_a_config_are_not_checked():
    check_packed(build("gpt_oss"), hf_inputs(token_batch()))
    check_packed(torch.nn.Linear(2, 2), hf_inputs(token_batch(), packed=True))
