"""Ceiling and gap breakdown: where each millisecond per output token goes, against a physical floor.

floor verify step  = bytes a verify step must read (target weights + KV at the profile's context) /
                     measured copy bandwidth; the weights at the fewest bytes an exact format of this
                     checkpoint stores them in (a GGUF checkpoint's own blocks), F_inc at the incumbent's;
ceiling (ms/token) = floor / L_best, L_best the best replayed accepted length (best tree within the
                     largest budget, or the incumbent's if higher).
With T output tokens over S steps (L_inc = T / S, the incumbent's measured tokens per step) and phase totals
from the timed run, the gaps in ms per output token are
  acceptance   floor / L_inc - floor / L_best
  weights      S * (F_inc - floor) / T           (bytes the incumbent's weight format reads beyond the fewest)
  verify       (verify - S * F_inc - S * D) / T  (verify work in the weight products beyond the floor)
  dispatch     S * D / T                         (verify forwards' time outside the weight products)
  drafting     draft / T
  host         (commit + host + wall outside steps: prefill, allocation) / T - batching
  batching     0 at batch 1, or what batched measurements attribute to batching
where D is the profile's dispatch curve (a target forward with its weight products removed) at the
incumbent's nodes per step: op dispatch and the small ops, which a faster GEMM cannot cut and fewer forwards
per token or a fused/compiled forward can. They add up to measured - ceiling exactly, by construction.
"""

from __future__ import annotations

from typing import Any

from specpilot.core import progress
from specpilot.core.costmodel import replay as rp
from specpilot.core.costmodel.predict import predict, predict_detail
from specpilot.core.costmodel.probe import probe
from specpilot.core.costmodel.profile import Profile, interpolate, profile, timed_run
from specpilot.core.engine import Engine
from specpilot.core.engine.engine import tree_spec
from specpilot.core.engine.model import DTYPES
from specpilot.core.engine.tree import chain_paths
from specpilot.core.recipe import Recipe

BUDGETS = (4, 8, 16, 32, 64)
CHAIN_DEPTHS = tuple(range(1, 9))


def dtype_name(engine: Engine) -> str:
    return next(k for k, v in DTYPES.items() if v == engine.target.dtype)


def _depth(recipe: Recipe) -> int:
    spec = tree_spec(recipe)
    return max(spec.depth if spec.kind == "dynamic" else 0, max((len(p) for p in spec.paths or []), default=0))


def gaps(prof: Profile, floor_ms: float, best_length: float, batching_ms_per_token: float = 0.0,
         incumbent_floor_ms: float | None = None) -> dict:
    """Measured and ceiling ms/token and the gap components, which sum to their difference."""
    T, S = prof.tokens, prof.steps
    own_floor = floor_ms if incumbent_floor_ms is None else incumbent_floor_ms
    totals = {k: v * S for k, v in prof.phases.items()}
    measured = prof.wall_ms / T
    ceiling = floor_ms / best_length
    outside = prof.wall_ms - sum(totals.values())
    dispatch = S * interpolate(prof.dispatch_curve, prof.nodes_per_step)
    parts = {
        "acceptance": floor_ms * S / T - ceiling,
        "weights": S * (own_floor - floor_ms) / T,
        "verify": (totals["verify_ms"] - S * own_floor - dispatch) / T,
        "dispatch": dispatch / T,
        "drafting": totals["draft_ms"] / T,
        "host": (totals["commit_ms"] + totals["host_ms"]) / T - batching_ms_per_token,
        "prompt": outside / T,  # outside the decode steps: the prompt's prefill and the caches' set-up
        "batching": batching_ms_per_token,
    }
    largest = max(parts, key=parts.get)
    return {
        "measured_ms_per_token": measured,
        "ceiling_ms_per_token": ceiling,
        "gaps": [{"component": k, "ms_per_token": v} for k, v in parts.items()],
        "largest_gap": largest,
    }


def analyse(engine: Engine, recipe: Recipe, prompts: list[list[int]], limits: list[int],
            request_ids: list[int] | None = None, budgets: tuple[int, ...] = BUDGETS,
            max_depth: int = rp.DEFAULT_MAX_DEPTH, probe_result: dict | None = None,
            batching_ms_per_token: float = 0.0, repeats: int = 7, candidates: tuple[Recipe, ...] = (),
            passes: int = 3, drift: bool | dict = False) -> dict:
    """Profile, replay and bound `recipe` on the requests; the JSON-ready cost report of a round.

    `candidates` are predicted too (key "predictions": tokens/s and speedup over the incumbent's prediction,
    which is robust to machine drift), each on its own drafter's replay of the same outputs. The recipe is
    timed over `passes` passes over the requests and the fastest pass is broken down.

    Key "drift": under numerics other than f32, with `drift` true, how far the deployment's own greedy plain
    decoding of these requests is from transformers float32 (core/costmodel/drift.py; Drift.to_dict()); a
    dict passed as `drift` is the drift measured earlier on the same requests, reported as it is (it cannot
    change: the numerics and the requests fix it). None under f32, which is the reference itself.
    """
    hw = probe_result or probe(str(engine.device), dtype_name(engine))
    with progress.step("cost model: timing the incumbent"):
        run = timed_run(engine, recipe, prompts, limits, request_ids, passes)
    with progress.step("cost model: profiling step costs"):
        prof = profile(engine, recipe, prompts, limits, run, request_ids, repeats)
    target, drafter = engine.models_for(recipe)
    extra = max(max_depth, *(_depth(r) for r in (recipe, *candidates))) + 2
    with progress.step("cost model: replaying acceptance"):
        traces = rp.record(target, prompts, limits, extra, rp.choice_rule(recipe), request_ids)
    drift_report = _drift(engine, recipe, prompts, limits, request_ids, traces, drift)
    made: dict = {}
    own = rp.replay_for(engine, recipe, traces, made)
    search = rp.replay_for(engine, recipe.replace(draft={"method": "model"}), traces, made) if drafter else own
    chain = {k: rp.simulate(search, chain_paths(k)) for k in CHAIN_DEPTHS}
    best = {b: rp.simulate(search, rp.best_tree(search, b, max_depth)) for b in budgets}
    incumbent = rp.run(own, tree_spec(recipe)).mean_accepted
    best_length = max([incumbent, *best.values(), *chain.values()])
    per_ms = hw["bandwidth_gb_s"] * 1e6
    own_floor_ms = prof.bytes["total"] / per_ms
    fewest = min(prof.bytes["weights"], prof.bytes.get("fewest_weights", prof.bytes["weights"]))
    floor_ms = (fewest + prof.bytes["kv"]) / per_ms
    report = gaps(prof, floor_ms, best_length, batching_ms_per_token, own_floor_ms)
    measured_tps = 1e3 / report["measured_ms_per_token"]
    ceiling_tps = 1e3 / report["ceiling_ms_per_token"]
    predicted = predict(prof, own, recipe)
    predictions = []
    for cand in candidates:
        detail = predict_detail(prof, rp.replay_for(engine, cand, traces, made), cand)
        predictions.append({"recipe": cand.name, "predicted_tokens_per_s": detail["tokens_per_s"],
                            "predicted_speedup": detail["tokens_per_s"] / predicted,
                            "mean_accepted_length": detail["mean_accepted_length"],
                            "approximations": detail["approximations"]})
    return {
        "recipe": recipe.name,
        "requests": len(prompts),
        "tokens": prof.tokens,
        "measured_tokens_per_s": measured_tps,
        "ceiling_tokens_per_s": ceiling_tps,
        "predicted_tokens_per_s": predicted,
        "above_ceiling": measured_tps > ceiling_tps,
        "floor_verify_ms": floor_ms,
        "incumbent_floor_verify_ms": own_floor_ms,
        **report,
        "profile": prof.to_dict(),
        "replay": {
            "drafter": search.method,
            "chain": chain,
            "best_tree": best,
            "best_tree_paths": rp.best_tree(search, max(budgets), max_depth),
            "incumbent": incumbent,
            "measured_incumbent": prof.mean_accepted_length,
            "best_length": best_length,
        },
        "predictions": predictions,
        "probe": hw,
        "drift": drift_report,
    }


def _drift(engine: Engine, recipe: Recipe, prompts: list[list[int]], limits: list[int],
           request_ids: list[int] | None, traces: list[rp.Trace], drift: bool | dict) -> dict[str, Any] | None:
    """The report's "drift": None under f32 or when not asked; a passed dict as it is; else measured on the
    deployment's own greedy plain decoding (the replay's traces when the recipe decodes greedily: those are the
    target's plain continuations, cut at each request's end; else decoded greedily here)."""
    if engine.numerics == "f32" or drift is False:
        return None
    if isinstance(drift, dict):
        return drift
    from specpilot.core.costmodel.drift import drift as measure

    if engine.target_dir is None:
        return None
    if rp.choice_rule(recipe).sampling == "greedy":
        outputs = [t.tokens[t.prompt_len:t.prompt_len + t.n_out] for t in traces]
    else:
        ids = request_ids if request_ids is not None else list(range(len(prompts)))
        outputs = [engine.generate([p], [n], None, [rid], speculative=False).tokens[0]
                   for p, n, rid in zip(prompts, limits, ids)]
    with progress.step(f"cost model: {engine.numerics} drift from transformers float32"):
        return {"numerics": engine.numerics,
                **measure(engine.target_dir, prompts, outputs, str(engine.device)).to_dict()}
