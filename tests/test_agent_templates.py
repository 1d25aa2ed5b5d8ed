"""The local agents' package: plugin templates are real modules that run on the demo pair and fill by
name, keys are values, and each agent says where it cannot apply (what the registry picks by)."""

from __future__ import annotations

import ast
import importlib
import tomllib
from importlib.resources import files
from pathlib import Path

import pytest

from specpilot.core.agents.local import (DEFAULT_ORDER, GAP_AGENTS, BatchingAgent, CurveKey, DrafterFormatAgent, DrafterKey,
                               LocalAgent, MemoryAgent, RuntimeAgent, WeightFormatAgent, templates)
from specpilot.core.mechanisms import declared_in, lookup
from specpilot.core.recipe import Recipe, builtin

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"adaptive": ("draft_length", {"window": 3, "margin": 0}),
             "hybrid": ("drafter", {"model_depth": 2})}
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


@pytest.fixture(scope="module")
def demo(one_thread):
    """Our engine over the shipped demo target and drafter, and prompts that repeat code (n-gram matches)."""
    from transformers import AutoTokenizer

    from specpilot.core.engine import Engine

    engine = Engine.load(REPO / "models" / "demo-target", REPO / "models" / "demo-drafter")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "demo-target")
    prompts = [tokenizer.encode(CODE * 2), tokenizer.encode("import os\n\n\n" + CODE)]
    return engine, prompts


def test_every_template_is_covered_here():
    shipped = {p.name.removesuffix(".py") for p in files(templates.__name__).iterdir()
               if p.name.endswith(".py") and p.name != "__init__.py"}
    assert shipped == set(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_template_renders_to_the_plugin_it_declares(name, tmp_path):
    kind, values = TEMPLATES[name]
    source = templates.render(name, **values, name=f"{name}_filled")
    path = tmp_path / f"{name}_filled.py"
    path.write_text(source)
    assert declared_in(path) == {(kind, f"{name}_filled")}
    constants = {n.targets[0].id: n.value.value for n in ast.parse(source).body
                 if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    assert constants == {key.upper(): value for key, value in values.items()}
    untouched = templates.source(name).splitlines()
    assert len(source.splitlines()) == len(untouched)
    assert sum(a != b for a, b in zip(source.splitlines(), untouched)) == len(values) + 1  # only the filled lines
    exec(compile(source, str(path), "exec"), {})
    assert lookup(kind, f"plugin:{name}_filled") is not None


def test_render_names_what_a_template_takes():
    with pytest.raises(ValueError, match="template 'adaptive' takes margin, name, window; missing margin"):
        templates.render("adaptive", window=2, name="x")
    with pytest.raises(ValueError, match="unknown depth"):
        templates.render("hybrid", model_depth=2, name="x", depth=4)


def test_the_adaptive_template_runs_losslessly_on_the_demo_pair(demo):
    from specpilot.core import forcing

    engine, prompts = demo
    module = importlib.import_module("specpilot.core.agents.local.templates.adaptive")
    assert module.length(6, []) == 6 and module.length(6, [1, 1]) == 1 + module.MARGIN
    recipe = Recipe.from_dict({"draft": {"length": "plugin:adaptive"}, "tree": {"depth": 6}})
    result = forcing.compare(engine, recipe, prompts, [24, 24])
    assert result["passed"] and result["tokens"] == 48, result
    fixed = recipe.replace(draft={"length": "fixed"})
    adaptive, full = engine.generate(prompts, 24, recipe), engine.generate(prompts, 24, fixed)
    assert adaptive.tokens == full.tokens
    assert sum(s.nodes for s in adaptive.steps) < sum(s.nodes for s in full.steps)  # it drafts shorter


def test_the_hybrid_template_runs_losslessly_on_the_demo_pair(demo):
    from specpilot.core import forcing

    engine, prompts = demo
    importlib.import_module("specpilot.core.agents.local.templates.hybrid")
    recipe = Recipe.from_dict({"draft": {"method": "plugin:hybrid"}, "tree": {"depth": 6}})
    result = forcing.compare(engine, recipe, prompts, [24, 24])
    assert result["passed"] and result["tokens"] == 48, result
    drafter = engine.drafter_for(recipe)
    used: list[int] = []
    original = drafter.model.draft
    drafter.model.draft = lambda *a: used.append(1) or original(*a)
    try:
        steps = engine.generate([prompts[0]], 24, recipe).steps
    finally:
        drafter.model.draft = original
    assert 0 < len(used) < len(steps)  # some steps looked up, some drafted with the model


def test_the_hybrid_template_serves_under_a_kv_budget_and_a_prefix_cache(demo):
    """A server's scheduler reserves the hybrid's drafter cache (its model's) and splits the prefix cache with it;
    the output is still plain decoding's."""
    from specpilot.core.engine.scheduler import drive

    engine, prompts = demo
    importlib.import_module("specpilot.core.agents.local.templates.hybrid")
    recipe = Recipe.from_dict({"draft": {"method": "plugin:hybrid"}, "tree": {"depth": 6}})
    plain = engine.generate(prompts, 16, recipe, speculative=False).tokens
    sched = engine.scheduler(recipe, 2, 256, kv_cache_bytes=64 * 2**20, prefix_cache_bytes=8 * 2**20)
    model = engine.drafter_for(recipe).kv_model
    assert model is engine.models_for(recipe)[1]
    per_token = engine.target.kv_bytes_per_token() + model.kv_bytes_per_token()
    assert sched.reservation(100) - sched.reservation(0) == 100 * per_token
    assert drive(sched, prompts * 2, [16] * 4).tokens == plain * 2
    assert sched.drafter.model.prefix is not None and sched.prefix.stats.hits > 0


def test_drafter_keys_are_what_cost_tools_name():
    for name in ("model", "ngram", "early_exit:1", "early_exit:12"):
        assert str(DrafterKey.parse(name)) == name
    assert DrafterKey.parse("early_exit:3") == DrafterKey("early_exit", 3)
    stock = builtin("stock")
    early = DrafterKey("early_exit", 2).drafting(stock)
    assert (early.draft.method, early.draft.exit_layer) == ("early_exit", 2)
    assert DrafterKey.of(early, 6) == DrafterKey("early_exit", 2)
    assert DrafterKey.of(early.replace(draft={"exit_layer": 0}), 6) == DrafterKey("early_exit", 3)  # half of 6
    assert DrafterKey.of(stock, 6) == DrafterKey("model")
    for layers in (3, 6):
        for recipe in (stock, early, early.replace(draft={"exit_layer": 0})):
            assert str(DrafterKey.of(recipe, layers)) == recipe.draft.drafter_key(layers)


def test_curve_keys_are_what_the_profile_names():
    from specpilot.core.costmodel.profile import drafter_variant_key

    stock = builtin("stock")
    for weights, runtime in (({}, {}), ({"drafter_format": "q4"}, {}), ({"drafter_format": "q8"}, {"linear": "onednn"}),
                             ({"format": "gguf", "drafter": True, "drafter_format": "q4"}, {})):
        recipe = stock.replace(weights=weights, runtime=runtime)
        key = CurveKey.of(recipe)
        assert str(key) == drafter_variant_key(recipe) and CurveKey.parse(str(key)) == key
    assert CurveKey.parse("gguf+q4") == CurveKey("gguf", "q4") and CurveKey("gguf", "q4").in_format("same") == \
        CurveKey("gguf")


def test_each_agent_says_where_its_mechanism_cannot_apply():
    cpu, gpu = {"probe": {"device": "cpu"}, "batch_size": 1}, {"probe": {"device": "cuda:0"}, "batch_size": 4}
    assert RuntimeAgent.applies(cpu) is None and "run on a CPU" in RuntimeAgent.applies(gpu)
    assert BatchingAgent.applies(gpu) is None and BatchingAgent.applies(cpu) == "batch size 1: no batching gap"
    assert WeightFormatAgent.applies(gpu) is None and "fused CUDA kernel" in WeightFormatAgent.applies(cpu)
    assert WeightFormatAgent.applies({**cpu, "profile": {"backend_curves": {"gguf": {1: 1.0}}}}) is None
    assert "no approximate drafter format" in DrafterFormatAgent.applies(cpu)
    q4 = {"native": {"model": {"1": 1.0}}, "native+q4": {"model": {"1": 0.5}}}  # a report read back from JSON
    assert DrafterFormatAgent.applies({"profile": {"drafter_backend_curves": q4}}) is None
    everywhere = set(DEFAULT_ORDER) - {RuntimeAgent, BatchingAgent, WeightFormatAgent, DrafterFormatAgent}
    for cls in everywhere | {MemoryAgent, LocalAgent}:
        assert cls.applies(cpu) is None and cls.applies(gpu) is None and cls.applies(None) is None, cls
    assert cls().applies(cpu) is None  # an instance answers too
    assert {c for agents in GAP_AGENTS.values() for c in agents} <= set(DEFAULT_ORDER)


def test_the_templates_ship_with_the_package():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"specpilot.core.agents.local", "specpilot.core.agents.local.templates"} <= set(setuptools["packages"])
