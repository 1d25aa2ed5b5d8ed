"""Bad input gets one clear line that says what to do."""

import json

import pytest
import transformers

import tiny_models
from specpilot.core.engine import Engine, GenerationError, ModelLoadError
from specpilot.core.recipe import Recipe, RecipeError


def test_unsupported_architecture_names_supported_ones(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"architecture GPT2LMHeadModel is not supported; supported: Llama 2/3, "
                                             r"Mistral, Qwen2/2.5, Qwen3"):
        Engine.load(tmp_path)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist; pass a local Hugging Face checkpoint directory"):
        Engine.load(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        Engine.load(tmp_path)
    tiny_models.build(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors files"):
        Engine.load(tmp_path / "m")


def test_corrupt_weights(tmp_path):
    tiny_models.build(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="could not be read .* corrupt or truncated"):
        Engine.load(tmp_path)


def test_vocabulary_mismatch(tmp_path):
    tiny_models.build(tmp_path / "t", vocab=101)
    tiny_models.build(tmp_path / "d", vocab=90)
    with pytest.raises(ModelLoadError, match=r"drafter vocabulary \(90\) does not match the target's \(101\)"):
        Engine.load(tmp_path / "t", tmp_path / "d")


def test_tokenizer_mismatch(tmp_path):
    tiny_models.build(tmp_path / "t")
    tiny_models.build(tmp_path / "d")
    for name, vocab in (("t", {"a": 0}), ("d", {"b": 0})):
        (tmp_path / name / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ModelLoadError, match="tokenizers of .* differ"):
        Engine.load(tmp_path / "t", tmp_path / "d")


def test_prompt_over_context_refused_before_work(tmp_path):
    tiny_models.build(tmp_path)
    engine = Engine.load(tmp_path)
    with pytest.raises(GenerationError, match=r"request 0: the context is 128 tokens: the prompt has 100 and "
                                              r"max_new_tokens asks for 40 more, but 28 fit; shorten the prompt"):
        engine.generate([[1] * 100], 40, speculative=False)


def test_model_drafter_without_checkpoint(tmp_path):
    """Without a drafter model, a recipe that drafts with one is refused in one line; the default (stock)
    is then prompt lookup, and it is still lossless."""
    from specpilot.core.recipe import builtin

    tiny_models.build(tmp_path)
    engine = Engine.load(tmp_path)
    with pytest.raises(ModelLoadError, match="needs a drafter checkpoint; pass --drafter DIR"):
        engine.generate([[1, 2]], 4, builtin("stock"))
    default = engine.generate([[1, 2, 1, 2]], 6)
    assert default.tokens == engine.generate([[1, 2, 1, 2]], 6, speculative=False).tokens


@pytest.mark.parametrize("text, message", [
    ("[tree]\nshape = 3\n", "unknown field tree.shape; allowed: policy, depth, budget, topk, paths"),
    ("[tree]\npolicy = \"forest\"\n", "tree.policy = 'forest' is not allowed; allowed: chain, static, dynamic"),
    ("[draft]\nmethod = \"oracle\"\n", "draft.method = 'oracle' is not allowed; allowed: model, ngram, early_exit"),
    ("[tree]\ndepth = 0\n", r"tree.depth must be an integer in \[1, 64\], got 0"),
    ("[tree]\ndepth = \"4\"\n", "tree.depth must be int, got '4'"),
    ("[gpu]\nx = 1\n", "unknown field 'gpu'"),
    ("[tree\n", "not valid TOML"),
    ("[tree]\npolicy = \"static\"\n", "tree.paths must list the tree's paths"),
    ("[verify]\nsampling = \"rejection\"\n[tree]\npolicy = \"dynamic\"\n", "'rejection' needs tree.policy = 'chain'"),
])
def test_recipe_errors_name_field_and_allowed_values(text, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.from_toml(text)


def test_recipe_toml_round_trip(tmp_path):
    recipe = Recipe.from_dict({"name": "x", "tree": {"policy": "static", "paths": [[0, 0], [1]]},
                               "verify": {"sampling": "seeded", "temperature": 0.7}})
    recipe.save(tmp_path / "r.toml")
    assert Recipe.load(tmp_path / "r.toml") == recipe
    assert Recipe.load(tmp_path / "r.toml").to_toml() == recipe.to_toml()
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.load(tmp_path / "missing.toml")
