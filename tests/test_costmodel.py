"""Cost model: replay equals real runs, tree search is monotone, gaps add up, predictions rank recipes."""

import json
import math

import pytest
import torch

from tiny_models import repeating_prompts

from specpilot.core.cli import build_parser
from specpilot.core.costmodel import replay as rp
from specpilot.core.costmodel import trees
from specpilot.core.costmodel.predict import drafter_cost, predict, predict_detail
from specpilot.core.costmodel.probe import probe
from specpilot.core.costmodel.profile import NODES, Profile, interpolate, profile
from specpilot.core.costmodel.report import analyse
from specpilot.core.engine import Engine, tree_spec
from specpilot.core.engine.decode import Verification
from specpilot.core.engine.tree import chain_paths, static_prefixes
from specpilot.core.recipe import Recipe, builtin
from specpilot.kernels.cpu import skinny

LIMITS = [26, 17, 22, 30]
FAKE_PROBE = {"bandwidth_gb_s": 20.0, "matmul_tflops": 0.1}


def prompts(n=4, vocab=101, seed=0):
    return repeating_prompts([5, 12, 3, 8][:n], vocab, seed)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def engine(pair_engine):
    return pair_engine


@pytest.fixture(scope="module")
def traces(engine):
    return rp.record(engine.target, prompts(), LIMITS, extra=12)


@pytest.fixture(scope="module")
def model_replay(engine, traces):
    return rp.teacher_force(engine.drafter_model, traces)


def measured_steps(engine, recipe):
    runs = [engine.generate([p], [n], recipe, [i]) for i, (p, n) in enumerate(zip(prompts(), LIMITS))]
    return [[a for s in r.steps for a in s.accepted] for r in runs]


@pytest.mark.parametrize("tree", [{"policy": "chain", "depth": 4},
                                  {"policy": "static", "paths": [[0, 0, 0], [0, 1], [1, 0], [2]]},
                                  {"policy": "dynamic", "depth": 5, "topk": 3, "budget": 12}])
def test_replay_equals_greedy_runs_step_by_step(engine, model_replay, tree):
    recipe = Recipe.from_dict({"tree": tree})
    runs = [engine.generate([p], [n], recipe, [i]) for i, (p, n) in enumerate(zip(prompts(), LIMITS))]
    sim = rp.run(model_replay, tree_spec(recipe))
    assert sim.accepted == [[a for s in r.steps for a in s.accepted] for r in runs]
    assert sim.nodes == [[s.nodes for s in r.steps] for r in runs]
    flat = [a for steps in sim.accepted for a in steps]
    assert sim.mean_accepted == sum(flat) / len(flat) and 1.0 < sim.mean_accepted < 5.0
    if tree["policy"] != "dynamic":
        assert rp.simulate(model_replay, tree_spec(recipe).paths) == sim.mean_accepted


def test_ngram_replay_equals_runs(engine, traces):
    recipe = Recipe.from_dict({"draft": {"method": "ngram", "ngram_max": 3}, "tree": {"policy": "chain", "depth": 6}})
    assert rp.run(rp.ngram_replay(traces, 3), tree_spec(recipe)).accepted == measured_steps(engine, recipe)


def test_seeded_replay_equals_runs(engine):
    v = {"sampling": "seeded", "temperature": 0.8, "top_p": 0.9, "seed": 7}
    ver = Verification(**v)
    replay = rp.teacher_force(engine.drafter_model, rp.record(engine.target, prompts(), LIMITS, 8, ver), "model", ver)
    for tree in ({"policy": "chain", "depth": 3}, {"policy": "dynamic", "depth": 4, "topk": 3, "budget": 10}):
        recipe = Recipe.from_dict({"tree": tree, "verify": v})
        assert rp.run(replay, tree_spec(recipe)).accepted == measured_steps(engine, recipe)


def test_best_tree_monotone_and_not_below_chain(engine, model_replay):
    lengths = []
    for budget in range(1, 17):
        paths = rp.best_tree(model_replay, budget, max_depth=6)
        assert len(static_prefixes(paths)) <= budget
        assert max(len(p) for p in paths) <= 6
        lengths.append(rp.simulate(model_replay, paths))
        if budget <= 6:
            assert lengths[-1] >= rp.simulate(model_replay, chain_paths(budget))
    assert all(b >= a for a, b in zip(lengths, lengths[1:]))
    assert lengths[-1] > rp.simulate(model_replay, chain_paths(6))
    paths = rp.best_tree(model_replay, 8, max_depth=6)
    measured = measured_steps(engine, Recipe.from_dict({"tree": {"policy": "static", "paths": paths}}))
    assert rp.run(model_replay, paths).accepted == measured


def test_sequoia_is_optimal_under_its_model():
    freq = [0.45, 0.2, 0.1, 0.05, 0.03]
    dp = trees.sequoia(freq, 12, 4)
    greedy = trees.grow_greedy(freq, 12, 4)
    for n in (1, 4, 8, 12):
        assert len(dp[n]) <= n and len(set(dp[n])) == len(dp[n])
        assert all(node[:-1] in set(dp[n]) | {()} for node in dp[n])
        assert trees.expected_length(freq, dp[n]) >= trees.expected_length(freq, greedy[:n]) - 1e-12
    assert dp[1] == [(0,)]
    assert trees.expected_length(freq, dp[4]) == pytest.approx(1 + 0.45 + 0.45 ** 2 + 0.2 + 0.1)


def test_gaps_add_up(engine):
    recipe = Recipe.from_dict({"tree": {"policy": "chain", "depth": 4}})
    candidates = (builtin("ngram"), builtin("early_exit"), builtin("dynamic"))
    report = analyse(engine, recipe, prompts(3), LIMITS[:3], budgets=(4, 8, 16), probe_result=FAKE_PROBE, repeats=3,
                     candidates=candidates)
    parts = {g["component"]: g["ms_per_token"] for g in report["gaps"]}
    assert set(parts) == {"acceptance", "weights", "verify", "dispatch", "drafting", "host", "prompt", "batching"}
    assert parts["weights"] == 0.0  # a safetensors checkpoint has no fewer-byte exact format here
    # dispatch: the verify forwards' time outside the weight products, measured on the same forward with
    # the products removed (on these tiny models the products cost next to nothing, so no ordering)
    prof = report["profile"]
    dispatch, full = prof["dispatch_curve"], prof["verify_curve"]
    assert set(dispatch) == set(full) and all(ms > 0 for ms in dispatch.values())
    steps = prof["steps"]
    expected = steps * interpolate(dispatch, prof["nodes_per_step"]) / prof["tokens"]
    assert parts["dispatch"] == pytest.approx(expected)
    diff = report["measured_ms_per_token"] - report["ceiling_ms_per_token"]
    assert math.isclose(sum(parts.values()), diff, rel_tol=1e-9)
    assert report["largest_gap"] == max(parts, key=parts.get)
    assert parts["batching"] == 0.0
    # the prompt: the wall time outside the steps (prefill, cache set-up), apart from the per-step host work
    outside = prof["wall_ms"] - steps * sum(prof["phases"].values())
    assert parts["prompt"] == pytest.approx(outside / prof["tokens"]) and parts["prompt"] > 0
    assert parts["host"] == pytest.approx(steps * (prof["phases"]["commit_ms"] + prof["phases"]["host_ms"])
                                          / prof["tokens"])
    assert report["ceiling_tokens_per_s"] > report["measured_tokens_per_s"] > 0
    assert report["replay"]["incumbent"] == report["replay"]["measured_incumbent"]
    assert sorted(report["replay"]["chain"]) == list(range(1, 9))
    best = report["replay"]["best_tree"]
    assert best[4] <= best[8] <= best[16] and best[16] >= report["replay"]["chain"][4]
    prof = report["profile"]
    assert sorted(prof["verify_curve"]) == list(NODES)
    assert prof["bytes"]["total"] == prof["bytes"]["weights"] + prof["bytes"]["kv"] > 0
    assert 0 < report["predicted_tokens_per_s"] < math.inf
    assert [p["recipe"] for p in report["predictions"]] == ["ngram", "early_exit", "dynamic"]
    assert all(0 < p["predicted_tokens_per_s"] < math.inf for p in report["predictions"])


def test_prediction_ranks_a_deeper_self_drafted_chain_higher(tiny_pair):
    target_dir, _, _ = tiny_pair
    engine = Engine.load(target_dir, target_dir)
    chain1 = Recipe.from_dict({"tree": {"policy": "chain", "depth": 1}})
    prof = profile(engine, chain1, prompts(2), LIMITS[:2], repeats=3)
    replay = rp.teacher_force(engine.drafter_model, rp.record(engine.target, prompts(2), LIMITS[:2], 10))
    assert 0 < predict(prof, replay, chain1) < math.inf
    # Every self-drafted token is accepted; with drafting a tenth of a verify step (the regime speculation
    # is for; fixed costs, since timings on a shared CPU are noisy), a deeper chain must be predicted faster.
    cheap = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    cheap.verify_curve = {n: 1.0 + 0.01 * n for n in cheap.verify_curve}
    cheap.backend_curves = {key: dict(cheap.verify_curve) for key in cheap.backend_curves}  # what predict reads
    cheap.drafters["model"].update(curve={w: 0.1 for w in cheap.drafters["model"]["curve"]}, fixed_ms=0.0,
                                   level_ms=0.0, prefill_ms=0.0)
    cheap.phases.update(draft_ms=0.1, verify_ms=1.02)
    speeds = [predict(cheap, replay, chain1.replace(tree={"depth": d})) for d in (1, 2, 4, 6)]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1] < math.inf
    dynamic = Recipe.from_dict({"tree": {"policy": "dynamic", "budget": 12}})
    detail = predict_detail(prof, replay, dynamic)
    assert not detail["approximations"] and detail["tokens_per_s"] > 0
    assert 1 < detail["mean_accepted_length"] <= 1 + 4
    stored = rp.Replay("model", replay.traces)  # no drafter model: dynamic trees are approximated
    assert predict_detail(prof, stored, dynamic)["approximations"]
    half = drafter_cost(prof, chain1.replace(draft={"method": "early_exit", "exit_layer": 2}))["curve"][1]
    ee1, full = prof.drafters["early_exit:1"]["curve"][1], prof.verify_curve[1]
    assert half == pytest.approx((ee1 + full) / 2)
    with pytest.raises(ValueError, match="replay"):
        predict(prof, replay, Recipe.from_dict({"draft": {"method": "ngram"}}))
    # Every linear backend this CPU runs gets its own measured verify curve; a recipe is priced on its own.
    runs_here = {"native", "onednn"} | ({"skinny", "fused"} if skinny.available() else set())
    assert set(prof.backend_curves) == runs_here and prof.backend_curves["native"] == prof.verify_curve
    halved = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    halved.backend_curves["onednn"] = {n: ms / 2 for n, ms in halved.verify_curve.items()}
    native = predict_detail(halved, replay, chain1)["step_ms"]["verify"]
    onednn = predict_detail(halved, replay, chain1.replace(runtime={"linear": "onednn"}))["step_ms"]["verify"]
    assert onednn == pytest.approx(native / 2)
    # The drafter runs on the recipe's backend too: its forwards are timed under every backend, and a
    # backend whose drafter forwards take a third of the time prices the drafter's forwards at a third.
    # ... and the drafter model in each approximate drafter format on the profiled backend
    assert set(prof.drafter_backend_curves) == runs_here | {"native+q8", "native+q4"}
    assert all(set(kinds) == set(prof.drafters) for key, kinds in prof.drafter_backend_curves.items() if "+" not in key)
    assert all(set(kinds) == {"model"} for key, kinds in prof.drafter_backend_curves.items() if "+" in key)
    curves = halved.drafter_backend_curves
    curves["onednn"] = {k: {w: ms / 3 for w, ms in curves["native"][k].items()} for k in curves["native"]}
    moved = drafter_cost(halved, chain1.replace(runtime={"linear": "onednn"}))
    own = drafter_cost(halved, chain1)
    assert own == halved.drafters["model"]
    assert moved["curve"] == pytest.approx({w: ms / 3 for w, ms in own["curve"].items()})
    assert moved["prefill_ms"] == pytest.approx(own["prefill_ms"] / 3) and moved["fixed_ms"] == own["fixed_ms"]


def test_probe_is_cached_per_device_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    first = probe("cpu", "float32")
    assert not first["cached"] and first["bandwidth_gb_s"] > 0 and first["matmul_tflops"] > 0
    spread = first["bandwidth_spread"]
    assert spread["min"] <= first["bandwidth_gb_s"] <= spread["max"]
    again = probe("cpu", "float32")
    assert again["cached"] and again["bandwidth_gb_s"] == first["bandwidth_gb_s"]
    assert (tmp_path / "probe.json").is_file()
    assert not probe("cpu", "float32", refresh=True)["cached"]


def test_cli_registers_profile_and_verify():
    args = build_parser().parse_args(["profile", "--recipe", "chain6", "--max-requests", "2", "--json"])
    assert args.recipe == "chain6" and args.json and args.max_requests == 2
    args = build_parser().parse_args(["verify", "--recipe", "ngram", "--workload", "w.jsonl"])
    assert args.recipe == "ngram" and args.workload == "w.jsonl"


def test_without_products_keeps_everything_but_the_weight_products(engine):
    """The dispatch probe's model runs the same ops minus the products (zero logits); the model is untouched."""
    from specpilot.core.costmodel.profile import without_products

    bare = without_products(engine.target)
    assert bare.layers[0].raw is engine.target.layers[0].raw and bare.matrix_bits == engine.target.matrix_bits
    cache = bare.new_cache(1, 16)
    with torch.inference_mode():
        logits = bare.step(torch.tensor([[3, 4, 5]]), cache, cache.lengths, torch.arange(3)[None],
                           torch.tril(torch.ones(3, 3, dtype=torch.bool))[None])
    assert logits.shape == (1, 3, engine.target.cfg.vocab_size) and not logits.any()
    assert engine.target.layers[0].qkv(torch.ones(1, 1, engine.target.cfg.hidden_size)).any()


def test_timed_run_keeps_the_fastest_pass():
    """Load only adds time, so of several passes over the requests the breakdown uses the fastest."""
    from types import SimpleNamespace

    from specpilot.core.costmodel.profile import timed_run
    from specpilot.core.engine.decode import StepStats

    seconds = iter([0.0, 3.0, 4.0, 1.0, 1.5, 2.0, 9.0])  # warm-up, then three passes over two requests

    class Clock:
        def generate(self, prompts, limits, recipe, ids, speculative=True):
            s = next(seconds)
            return SimpleNamespace(tokens=[[1, 2]], seconds=s, steps=[StepStats(0.0, s, 0.0, 0.0, 1, [2])])

    run = timed_run(Clock(), None, [[5], [6]], [2, 2], passes=3)
    assert run.seconds == [1.0, 1.5] and [s.verify_ms for s in run.steps] == [1.0, 1.5]


def test_profile_skips_what_does_not_fit_and_still_prices_drafter_formats(tiny_pair, monkeypatch):
    """With memory for the drafter's q8/q4 copies but not for a backend's packed target, the profile
    measures neither that backend's target nor its drafter (no copy is built), and still the formats."""
    from specpilot.core.engine import ram_budget

    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    stock = builtin("stock")
    formats = [stock.replace(weights={"drafter_format": f}) for f in ("q8", "q4")]
    avail = 4 * max(engine.packed_bytes(r) for r in formats) + 1
    assert engine.packed_bytes(stock.replace(runtime={"linear": "onednn"})) > avail / 4
    monkeypatch.setattr(ram_budget, "available_bytes", lambda: avail)
    prof = profile(engine, stock, prompts(2), LIMITS[:2], repeats=1)
    assert set(prof.backend_curves) == {"native"}
    assert set(prof.drafter_backend_curves) == {"native", "native+q8", "native+q4"}
    assert not any(key.backend in ("onednn", "skinny") for key in engine._models)
