"""Linear backends (runtime.linear = "onednn" | "skinny" | "fused"): the same projections through oneDNN's
GEMM or SpecPilot's AVX2 kernel (fused: whole layers in C around it); logits match the default backend, greedy output stays lossless under forcing
against transformers, and a backend is refused clearly where it cannot run."""

import pytest
import torch

import tiny_models
from specpilot.core import forcing
from specpilot.core.engine import Engine
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.recipe import Recipe, RecipeError
from specpilot.kernels.cpu import skinny

ONEDNN = {"runtime": {"linear": "onednn"}}
BACKENDS = [
    pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                                    reason="torch built without oneDNN")),
    pytest.param("skinny", marks=pytest.mark.skipif(not skinny.available(), reason="no AVX2+FMA or no C compiler")),
]
FLOAT32_BACKENDS = BACKENDS + [
    pytest.param("fused", marks=pytest.mark.skipif(not skinny.available(), reason="no AVX2+FMA or no C compiler")),
]


def runtime(backend: str) -> dict:
    return {"runtime": {"linear": backend}}


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_logits_match_native(backend, pair_engine, one_thread):
    target, _ = pair_engine.models_for(Recipe.from_dict(runtime(backend)))
    assert target is not pair_engine.target and target.layers[0].raw is pair_engine.target.layers[0].raw
    prompt = tiny_models.repeating_prompts([12])[0]
    for width in (1, 7):
        logits = []
        for model in (pair_engine.target, target):
            cache = model.new_cache(1, 64)
            model.prefill_row(cache, 0, prompt)
            toks = torch.tensor([prompt[:width]])
            anc = torch.tril(torch.ones(width, width, dtype=torch.bool))[None] if width > 1 else None
            with torch.inference_mode():
                logits.append(model.step(toks, cache, cache.lengths, torch.arange(width)[None], anc))
        assert logits[0].shape == logits[1].shape == (1, width, 101)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        if backend == "onednn" and width == 1:
            assert torch.equal(logits[1], logits[0])  # onednn keeps the default GEMV for one row: bit-identical


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_passes_forcing_against_transformers(backend, tiny_pair, pair_engine, one_thread):
    _, _, hf_target = tiny_pair
    prompts = tiny_models.repeating_prompts([9, 14, 20], seed=3)
    limits = [24, 24, 24]
    base = runtime(backend)
    for recipe in (Recipe.from_dict(base),
                   Recipe.from_dict({**base, "draft": {"method": "ngram"}, "tree": {"depth": 6}}),
                   Recipe.from_dict({**base, "tree": {"policy": "dynamic", "depth": 4, "budget": 10}})):
        result = forcing.compare(pair_engine, recipe, prompts, limits, reference=hf_target)
        assert result["passed"], result
        assert result["clear_mismatches"] == 0 and result["tokens"] == sum(limits)
    ar = pair_engine.generate(prompts, limits, speculative=False).tokens
    assert ar == [tiny_models.hf_greedy(hf_target, p, n) for p, n in zip(prompts, limits)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_computes_on_the_same_values_and_passes_forcing(backend, tiny_pair, one_thread):
    """A bf16 model's rows go through float32 products of its exact weights, each output rounded to bf16."""
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir, dtype="bfloat16")
    recipe = Recipe.from_dict({**runtime(backend), "draft": {"method": "ngram"}, "tree": {"depth": 6}})
    target, _ = engine.models_for(recipe)
    x = torch.randn(2, 5, 64).bfloat16()
    out = target.layers[0].qkv(x)
    assert out.dtype == torch.bfloat16
    exact = (x.float() @ target.layers[0].raw["qkv"].float().T).bfloat16()
    assert (out.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2 ** -7
    if backend == "onednn":  # one row keeps the model's own bf16 GEMV
        assert torch.equal(target.layers[0].qkv(x[:1, :1]), engine.target.layers[0].qkv(x[:1, :1]))
    prompts = tiny_models.repeating_prompts([9, 14, 20], seed=3)
    reference = forcing.load_reference(str(target_dir), "bfloat16")
    result = forcing.compare(engine, recipe, prompts, [24, 24, 24], reference=reference)
    assert result["passed"] and result["clear_mismatches"] == 0, result


def test_onednn_refusals(tmp_path):
    tiny_models.build(tmp_path, "llama2", init=0.1).to(torch.bfloat16).save_pretrained(tmp_path)
    engine = Engine.load(tmp_path)
    with pytest.raises(ModelLoadError, match="runtime.linear = 'onednn' needs native weights, not packed12"):
        engine.models_for(Recipe.from_dict({**ONEDNN, "weights": {"format": "packed12"}}))
    with pytest.raises(RecipeError, match=r"runtime.linear = 'mkl' is not allowed; allowed: native, onednn, skinny, fused"):
        Recipe.from_dict({"runtime": {"linear": "mkl"}})


def test_recipes_stored_before_runtime_linear_still_load():
    old = Recipe.from_dict({"runtime": {"compile": False, "cuda_graphs": False}})
    assert old.runtime.linear == "native" and "compile" not in old.to_toml()
    for key in ("compile", "cuda_graphs"):
        with pytest.raises(RecipeError, match=f"runtime.{key} = true is not implemented by this engine; remove it"):
            Recipe.from_dict({"runtime": {key: True}})
    with pytest.raises(RecipeError, match="unknown field runtime.graphs"):
        Recipe.from_dict({"runtime": {"graphs": False}})
