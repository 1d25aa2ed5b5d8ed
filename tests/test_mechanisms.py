"""The mechanism registry: every kind registered and looked up by (kind, name), unknown names refused at
validation with the kind and the known names, no silent fallback for `plugin:` names, the lossy test
mechanism out of the product, generated interface documentation whose examples work, and a draft-length
plugin that stays lossless against the transformers reference."""

from __future__ import annotations

import pytest

from tiny_models import repeating_prompts

from specpilot.core import forcing
from specpilot.core.engine.decode import GenerationError
from specpilot.core.mechanisms import (UnknownMechanism, builtin_names, check_recipe, declared, interfaces_doc, lookup,
                             kinds, names, register)
from specpilot.core.recipe import Recipe, RecipeError

LIMITS = [24, 17, 20]


def prompts():
    return repeating_prompts([6, 11, 4], 101, 1)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def test_every_kind_has_its_builtins_registered():
    expected = {
        "drafter": ("model", "ngram", "early_exit"),
        "tree_policy": ("chain", "static", "dynamic"),
        "draft_length": ("fixed",),
        "acceptance": ("greedy", "seeded", "rejection"),
        "batching": ("fixed", "budget", "allocate", "cap"),
        "weight_format": ("native", "packed12", "gguf"),
        "linear_backend": ("native", "onednn", "skinny", "fused"),
        "drafter_format": ("same", "q8", "q4", "blocks8"),
    }
    assert {k: builtin_names(k) for k in kinds()} == expected


@pytest.mark.parametrize("field, value, kind", [
    ("draft.method", "oracle", "drafter"), ("draft.length", "p_min", "draft_length"),
    ("tree.policy", "forest", "tree_policy"), ("verify.sampling", "nucleus", "acceptance"),
    ("weights.format", "gguf_q4", "weight_format"), ("runtime.linear", "mkl", "linear_backend"),
    ("batching.policy", "greedy", "batching"), ("weights.drafter_format", "q2", "drafter_format"),
])
def test_unknown_builtin_name_names_kind_and_known_names(field, value, kind):
    section, key = field.split(".")
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict({section: {key: value}})
    message = str(err.value)
    assert f"{field} = {value!r}" in message and kind in message
    assert all(name in message for name in builtin_names(kind))


def test_lossy_top2_is_not_in_the_product():
    assert "lossy_top2" not in builtin_names("acceptance")
    with pytest.raises(RecipeError, match="verify.sampling = 'lossy_top2' is not allowed"):
        Recipe.from_dict({"verify": {"sampling": "lossy_top2"}})


@pytest.mark.parametrize("section, key", [("verify", "sampling"), ("batching", "policy"), ("draft", "length"),
                                          ("draft", "method"), ("weights", "format"), ("runtime", "linear")])
def test_unloaded_plugin_name_runs_nothing(pair_engine, section, key):
    """Before the registry, `plugin:NAME` sampling ran seeded sampling and `plugin:NAME` batching ran the
    cap policy; now nothing runs and the error names the kind and the known names."""
    recipe = Recipe.from_dict({section: {key: "plugin:not_loaded"}})
    with pytest.raises(UnknownMechanism, match=f"{section}.{key} = 'plugin:not_loaded' is not allowed; allowed: "):
        check_recipe(recipe)
    with pytest.raises(UnknownMechanism, match="add plugins/not_loaded.py"):
        pair_engine.generate([[1, 2, 3]], 4, recipe)
    with pytest.raises(UnknownMechanism, match="not_loaded"):
        pair_engine.serve([[1, 2, 3]], [4], recipe, max_batch=2)


def test_malformed_plugin_name_is_refused_at_validation():
    with pytest.raises(RecipeError, match=r"tree.policy = 'plugin:a b' is not allowed; allowed: chain, static"):
        Recipe.from_dict({"tree": {"policy": "plugin:a b"}})
    assert Recipe.from_dict({"tree": {"policy": "plugin:wide-root.v2"}}).tree.policy == "plugin:wide-root.v2"


def test_plugin_cannot_shadow_a_builtin():
    with pytest.raises(UnknownMechanism, match="'greedy' is a built-in"):
        register("acceptance", "greedy", object())


def test_workspace_plugins_are_declared_from_their_text_without_running(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "adaptive.py").write_text(
        "raise SystemExit('must not run')\nfrom specpilot.core.mechanisms import register\n"
        "register('draft_length', 'adaptive', lambda depth, recent: 1)\n")
    assert declared(tmp_path) == {("draft_length", "adaptive")}
    check_recipe(Recipe.from_dict({"draft": {"length": "plugin:adaptive"}}), tmp_path)
    with pytest.raises(UnknownMechanism, match=r"allowed: fixed, plugin:adaptive"):
        check_recipe(Recipe.from_dict({"draft": {"length": "plugin:other"}}), tmp_path)


def test_interface_doc_is_generated_with_a_working_example_per_kind():
    doc = interfaces_doc()
    for kind in kinds().values():
        assert f"## {kind.name} (recipe field {kind.field}" in doc
        before = set(names(kind.name, builtin=False))
        exec(compile(kind.example, f"<example {kind.name}>", "exec"), {})
        added = set(names(kind.name, builtin=False)) - before
        assert len(added) == 1, (kind.name, added)
    from specpilot.core.agents.base import PLUGIN_INTERFACES_DOC

    assert PLUGIN_INTERFACES_DOC == doc  # one source: the registry
    assert "lossy" not in doc


def test_draft_length_plugin_is_lossless_and_drafts_less(pair_engine):
    """An acceptance-adaptive draft length, against the transformers reference (token forcing): same
    tokens as stock, fewer nodes verified."""
    register("draft_length", "test_short", lambda depth, recent: 1 if recent and recent[-1] <= 1 else depth)
    recipe = Recipe.from_dict({"draft": {"length": "plugin:test_short"}, "tree": {"depth": 6}})
    fixed = recipe.replace(draft={"length": "fixed"})
    short = [pair_engine.generate([p], [n], recipe, [i]) for i, (p, n) in enumerate(zip(prompts(), LIMITS))]
    full = [pair_engine.generate([p], [n], fixed, [i]) for i, (p, n) in enumerate(zip(prompts(), LIMITS))]
    assert [r.tokens for r in short] == [r.tokens for r in full]
    assert sum(s.nodes for r in short for s in r.steps) < sum(s.nodes for r in full for s in r.steps)
    # continuous batching caps each row by the same policy: the same tokens, with fewer nodes than fixed depth
    limits = list(LIMITS)
    served = pair_engine.serve(prompts(), limits, recipe, max_batch=3, request_ids=list(range(len(limits))))
    full_served = pair_engine.serve(prompts(), limits, fixed, max_batch=3, request_ids=list(range(len(limits))))
    assert served.tokens == [r.tokens[0] for r in full] == full_served.tokens
    assert sum(s.nodes for s in served.steps) < sum(s.nodes for s in full_served.steps)
    with pytest.raises(GenerationError, match="both set each row's depth"):
        pair_engine.serve([prompts()[0]], [4], recipe.replace(batching={"policy": "budget"}), max_batch=2)


def test_draft_length_plugin_passes_forcing(pair_engine, tiny_pair):
    register("draft_length", "test_halve", lambda depth, recent: max(1, depth // 2))
    recipe = Recipe.from_dict({"draft": {"length": "plugin:test_halve"}, "tree": {"policy": "dynamic", "depth": 6}})
    result = forcing.compare(pair_engine, recipe, prompts(), LIMITS, tiny_pair[2])
    assert result["passed"] and result["tokens"] == sum(LIMITS), result


def test_lookup_returns_the_registered_implementation():
    impl = lambda policy, alphas: [1] * len(alphas)  # noqa: E731
    register("batching", "test_ones", impl)
    assert lookup("batching", "plugin:test_ones") is impl
    with pytest.raises(UnknownMechanism):
        lookup("batching", "test_ones")  # a plugin is named with its prefix
