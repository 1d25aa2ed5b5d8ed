"""packed12 as an engine mechanism: greedy output equals native in float32."""

import pytest
import torch

import tiny_models
from specpilot.core.engine import Engine
from specpilot.core.engine.weights import WeightFormatError
from specpilot.core.recipe import Recipe


def test_packed12_greedy_equals_native(tmp_path):
    hf = tiny_models.build(tmp_path, "qwen2", init=0.1, layers=2)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    engine = Engine.load(tmp_path, tmp_path, dtype="float32")
    prompts = [[3, 5, 7, 11, 13], [2, 4, 8]]
    native = engine.generate(prompts, 20, speculative=False)
    packed = Recipe.from_dict({"weights": {"format": "packed12", "drafter": True}})
    ar_packed = engine.generate(prompts, 20, packed, speculative=False)
    spec_packed = engine.generate(prompts, 20, packed)
    assert ar_packed.tokens == native.tokens
    assert spec_packed.tokens == native.tokens
    target, drafter = engine.models_for(packed)
    assert target is not engine.target and drafter is not engine.drafter_model
    assert (target.weight_format, drafter.weight_format) == ("packed12", "packed12")
    assert engine.target.weight_format == "native"


def test_packed12_refuses_weights_bf16_cannot_hold(tmp_path):
    tiny_models.build(tmp_path, "llama2", init=0.1)
    engine = Engine.load(tmp_path, dtype="float32")
    with pytest.raises(WeightFormatError, match="bfloat16 holds exactly"):
        engine.generate([[1, 2, 3]], 4, Recipe.from_dict({"weights": {"format": "packed12"}}), speculative=False)
