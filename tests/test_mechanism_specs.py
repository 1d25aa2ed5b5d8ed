"""Adding a mechanism is one registration: a toy weight format and a toy drafter registered here through
`specpilot.core.mechanisms.register` alone (no other file knows them) are seen by recipe validation and the presets,
the engine's memory budget, the cost model's pricing, the agents (the weight-format agent proposes the toy
format) and the agents' interface doc."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specpilot.core import mechanisms
from specpilot.core.agents.base import AgentContext, Candidate
from specpilot.core.agents.local import WeightFormatAgent
from specpilot.core.costmodel.profile import drafter_variant_key, variant_key
from specpilot.core.costmodel.tools import CostTools
from specpilot.core.engine import Engine
from specpilot.core.engine.drafters import NgramDrafter
from specpilot.core.mechanisms import Needs, Preset, declared_in, interfaces_doc, register
from specpilot.core.recipe import Recipe, RecipeError, builtin, presets

TOY_BYTES = 2.0  # per weight of target and drafter: a private copy, as packed12's
TABLE_BYTES = 4096  # the toy drafter's own table, once per model


def _toy_format(model: Any, source: str | None, recipe: Any) -> Any:
    """A lossless toy format: the weights as loaded."""
    return model


def _toy_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    """A toy drafter: prompt lookup, as draft.method 'ngram' (whose measurements price it)."""
    return NgramDrafter(recipe.draft.ngram_max)


def _no_drafter_model(recipe: Any) -> str | None:
    if recipe.weights.drafter_format != "same":
        return "draft.method = 'toy_lookup' has no drafter model to format: set weights.drafter_format = 'same'"
    return None


@pytest.fixture
def toys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy built-ins registered on a copy of the registry, which the test's end throws away."""
    mechanisms.ensure_builtins()
    monkeypatch.setattr(mechanisms, "_MECHANISMS", dict(mechanisms._MECHANISMS))
    register("weight_format", "toy16", _toy_format, "a toy format read by its own kernel", builtin=True,
             memory=TOY_BYTES, curve="toy16", drafter=True,
             constraints=(Needs("runtime.linear", "native", "runs its own toy kernel"),),
             presets=(Preset("stock-toy16"),))
    register("drafter", "toy_lookup", _toy_drafter, "a toy prompt lookup", builtin=True,
             memory=lambda weights: TABLE_BYTES, stand_in="ngram", constraints=(_no_drafter_model,))


def test_validation_and_presets_see_the_toys(toys: None) -> None:
    toy = Recipe.from_dict({"weights": {"format": "toy16"}, "draft": {"method": "toy_lookup"}})
    assert toy.weights.format == "toy16" and toy.draft.method == "toy_lookup"
    with pytest.raises(RecipeError, match=r"weights.format = 'toy16' runs its own toy kernel; set "
                                          r"runtime.linear = 'native'"):
        toy.replace(runtime={"linear": "onednn"})
    with pytest.raises(RecipeError, match="'toy_lookup' has no drafter model"):
        toy.replace(weights={"drafter_format": "q4"})
    with pytest.raises(RecipeError, match=r"allowed: native, packed12, gguf, toy16\b"):
        Recipe.from_dict({"weights": {"format": "toy8"}})
    assert builtin("stock-toy16").to_dict() == builtin("stock").replace(
        name="stock-toy16", weights={"format": "toy16", "drafter": True}).to_dict()
    assert list(presets())[-1] == "stock-toy16"


def test_the_toys_are_gone_after_the_test() -> None:
    with pytest.raises(RecipeError, match="'toy16' is not allowed") as err:
        Recipe.from_dict({"weights": {"format": "toy16"}})
    assert "toy16" not in str(err.value).split("allowed:")[-1]
    assert "stock-toy16" not in presets()


def test_the_memory_budget_sees_the_toys(toys: None, tiny_pair: Any) -> None:
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    weights = sum(m.numel() for m in engine.target.matrices()) + sum(m.numel() for m in engine.drafter_model.matrices())
    toy = builtin("stock-toy16")
    assert engine.packed_bytes(toy) == int(TOY_BYTES * weights)
    engine.models_for(toy)
    assert engine.packed_bytes(toy) == 0  # converted once, cached
    lookup = toy.replace(draft={"method": "toy_lookup"})
    assert engine.packed_bytes(lookup) == TABLE_BYTES
    ngram = lookup.replace(draft={"method": "ngram"})
    prompt = [5, 9, 5, 9, 5, 9, 7, 5, 9]
    assert engine.generate([prompt], 12, lookup).tokens == engine.generate([prompt], 12, ngram).tokens
    assert engine.packed_bytes(lookup) == 0


def test_the_cost_model_and_the_agents_price_the_toys(toys: None, tiny_pair: Any, one_thread: None,
                                                      tmp_path: Any) -> None:
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [(base := torch.randint(0, 101, (n,), generator=g).tolist()) + base[: n // 2] for n in (6, 10)]
    stock = builtin("stock")
    tools = CostTools.from_engine(engine, stock, prompts, [16, 12], budgets=(4,),
                                  probe_result={"bandwidth_gb_s": 20.0, "matmul_tflops": 0.1}, repeats=1)
    toy = builtin("stock-toy16")
    assert variant_key(toy) == "toy16" and "toy16" in tools.profile.backend_curves  # measured as its own variant
    lookup = stock.replace(draft={"method": "toy_lookup"}, tree={"depth": 6})  # priced as its stand-in
    assert tools.predict(lookup) == pytest.approx(tools.predict(lookup.replace(draft={"method": "ngram"})))
    curve = tools.profile.backend_curves["toy16"]
    native = tools.profile.backend_curves[variant_key(stock)]
    # a toy kernel twice as fast as the stock one's measured curve (halving the toy's own noisy curve could
    # still leave it slower on a loaded machine)
    tools.profile.backend_curves["toy16"] = {n: ms / 2 for n, ms in native.items()}
    # and its drafter priced as stock's: under load the toy drafter's own noisy curve could outweigh the gain
    drafters = tools.profile.drafter_backend_curves
    if drafter_variant_key(stock) in drafters:
        drafters["toy16"] = drafters[drafter_variant_key(stock)]
    assert tools.predict(toy) > tools.predict(stock)
    assert WeightFormatAgent.applies({"profile": {"backend_curves": {"toy16": curve}}}) is None
    ctx = AgentContext(deployment={"device": "cpu"}, recipe=stock, cost_report={}, memory=[], direction="verify",
                       workspace=tmp_path, tuning_summary={}, seed=0, tools=tools)
    out = WeightFormatAgent().propose(ctx, lambda chunk: None)
    assert isinstance(out, Candidate) and out.recipe.weights.format == "toy16" and out.recipe.weights.drafter, out


def test_the_agents_doc_lists_the_toys_and_a_workspace_cannot_add_built_ins(toys: None, tmp_path: Any) -> None:
    from specpilot.core.agents import base

    doc = interfaces_doc()
    assert "weight_format (recipe field weights.format; built-ins: native, packed12, gguf, toy16)" in doc
    assert "drafter (recipe field draft.method; built-ins: model, ngram, early_exit, toy_lookup)" in doc
    assert base.PLUGIN_INTERFACES_DOC == doc
    plugin = tmp_path / "sneaky.py"
    plugin.write_text("from specpilot.core.mechanisms import register\n"
                      "register('weight_format', 'sneaky', lambda m, s, r: m, builtin=True)\n"
                      "register('weight_format', 'plain', lambda m, s, r: m)\n")
    assert declared_in(plugin) == {("weight_format", "plain")}
    with pytest.raises(mechanisms.UnknownMechanism, match="'toy16' is a built-in"):
        register("weight_format", "toy16", _toy_format)
