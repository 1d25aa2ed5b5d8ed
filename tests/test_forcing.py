"""Token forcing passes honest recipes and our AR, fails a lossy mechanism, truncated and padded outputs."""

import pytest
import torch

from conftest import register_test_plugin
from tiny_models import repeating_prompts

from specpilot.core import forcing
from specpilot.core.engine.decode import Verification
from specpilot.core.recipe import Recipe

LIMITS = [24, 17, 20, 28]
HONEST = {
    "chain": {"tree": {"policy": "chain", "depth": 4}},
    "static": {"tree": {"policy": "static", "paths": [[0, 0, 0], [0, 1], [1, 0], [2]]}},
    "dynamic": {"tree": {"policy": "dynamic", "depth": 5, "topk": 3, "budget": 12}},
    "ngram": {"draft": {"method": "ngram"}, "tree": {"policy": "chain", "depth": 6}},
    "early_exit": {"draft": {"method": "early_exit", "exit_layer": 1}},
}
SEEDED = {"sampling": "seeded", "temperature": 0.8, "top_p": 0.9, "seed": 5}


def prompts(n=4, vocab=101, seed=1):
    return repeating_prompts([6, 11, 4, 9][:n], vocab, seed)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def engine(pair_engine):
    return pair_engine


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return tiny_pair[2]


@pytest.fixture(scope="module")
def stock(engine, reference):
    recipe, speculative = forcing.stock_for(engine, None)
    return forcing.run_forced(engine, recipe, prompts(), LIMITS, reference, speculative=speculative)


@pytest.fixture(scope="module")
def ar_outputs(engine):
    return [engine.generate([p], [n], None, [i], speculative=False).tokens[0]
            for i, (p, n) in enumerate(zip(prompts(), LIMITS))]


def test_stock_and_ar_match_the_reference(engine, reference, stock):
    assert stock.tokens == sum(LIMITS) and stock.mismatches == 0
    result = forcing.compare(engine, None, prompts(), LIMITS, reference, stock=stock)
    assert result["passed"] and result["rate"] == 0.0 and result["threshold"] == pytest.approx(0.005)
    assert set(result) >= {"stock_rate", "rate", "threshold", "passed", "near_ties", "clear_mismatches", "stock"}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_recipes_pass(engine, reference, stock, name):
    result = forcing.compare(engine, Recipe.from_dict(HONEST[name]), prompts(), LIMITS, reference, stock=stock)
    assert result["passed"], result
    assert result["tokens"] == sum(LIMITS)


def test_seeded_recipe_passes_against_seeded_stock(engine, reference):
    recipe = Recipe.from_dict({"tree": {"policy": "dynamic", "depth": 4, "topk": 3, "budget": 10}, "verify": SEEDED})
    result = forcing.compare(engine, recipe, prompts(3), LIMITS[:3], reference)
    assert result["passed"] and result["stock_rate"] == 0.0, result


def test_lossy_top2_fails(engine, reference, stock, ar_outputs):
    lossy = Recipe.from_dict({"verify": {"sampling": register_test_plugin("lossy_top2")}})
    outputs = [engine.generate([p], [n], lossy, [i]).tokens[0] for i, (p, n) in enumerate(zip(prompts(), LIMITS))]
    assert outputs != ar_outputs
    result = forcing.compare(engine, lossy, prompts(), LIMITS, reference, stock=stock)
    assert not result["passed"] and result["rate"] > result["threshold"]
    assert result["clear_mismatches"] + result["near_ties"] == result["mismatches"] > 0
    assert any(result["result"]["first"])


def test_truncated_and_padded_outputs_fail(reference, ar_outputs):
    ps = prompts()
    threshold = forcing.MARGIN_PP
    assert forcing.force(reference, ps, ar_outputs, LIMITS).verdict(threshold)
    cut = [ar_outputs[0][:-3]] + ar_outputs[1:]
    truncated = forcing.force(reference, ps, cut, LIMITS)
    assert truncated.truncated == 1 and truncated.mismatches == 3 and not truncated.verdict(threshold)
    assert truncated.first[0] == [LIMITS[0] - 3, LIMITS[0] - 2, LIMITS[0] - 1]
    empty = forcing.force(reference, ps, [[]] * 4, LIMITS)
    assert empty.truncated == 4 and empty.rate == 1.0
    long = [ar_outputs[0] + [1, 2]] + ar_outputs[1:]
    padded = forcing.force(reference, ps, long, LIMITS)
    assert padded.padded == 1 and padded.mismatches == 2 and not padded.verdict(threshold)
    eos = ar_outputs[1][5]
    stop = ar_outputs[1].index(eos)
    after_eos = forcing.force(reference, ps[1:2], [ar_outputs[1]], LIMITS[1:2], eos_token_ids=[eos])
    assert after_eos.padded == 1 and after_eos.mismatches == LIMITS[1] - stop - 1
    ended = forcing.force(reference, ps[1:2], [ar_outputs[1][: stop + 1]], LIMITS[1:2], eos_token_ids=[eos])
    assert ended.mismatches == 0 and ended.truncated == 0 and ended.tokens == stop + 1


def test_near_ties_are_counted_apart(reference, monkeypatch):
    ps = prompts(2)
    wrong = [[(t + 1) % 101 for t in range(n)] for n in LIMITS[:2]]
    monkeypatch.setattr(forcing, "EPSILON", 0.0)
    clear = forcing.force(reference, ps, wrong, LIMITS[:2])
    monkeypatch.setattr(forcing, "EPSILON", float("inf"))
    ties = forcing.force(reference, ps, wrong, LIMITS[:2])
    assert clear.mismatches == ties.mismatches > 0
    assert clear.near_ties == 0 and clear.clear == clear.mismatches
    assert ties.near_ties == ties.mismatches and ties.clear == 0


def test_rejection_sampling_is_refused(engine, reference):
    recipe = Recipe.from_dict({"verify": {"sampling": "rejection"}})
    with pytest.raises(forcing.ForcingError, match="seeded"):
        forcing.compare(engine, recipe, prompts(1), LIMITS[:1], reference)
    with pytest.raises(forcing.ForcingError):
        forcing.force(reference, prompts(1), [[1]], [1], Verification("rejection"))
