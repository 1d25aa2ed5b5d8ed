"""Predicted tokens/s of any recipe from a profile and a replay, before the recipe is run.

Step time = draft + verify + commit/host:
  draft   model/early-exit drafters: per-call host work + per level (host work + a forward of that level's
          width), from the profile's drafter curves and real draft() timings; the drafter's prompt prefill
          once per request. On another linear backend than the profiled one, the drafter's forwards are
          scaled by the two backends' measured drafter curves (the drafter runs on the recipe's backend).
          An early exit at an unmeasured layer: interpolated per layer between the measured early exit
          and the full target. n-gram: the lookup time measured while replaying it.
  verify  the target's cost curve (under the recipe's linear backend) at the mean nodes per step.
  commit/host  the incumbent's measured means.
Microbenchmarks fix the shape of these costs, the profiled run their level: draft and verify are scaled by
measured / modelled for the profiled recipe (load_factors), which absorbs the per-step work around the
forwards and the machine's load at the time.
Acceptance and nodes per step come from the replay: exact for chains, static and dynamic trees and n-gram
drafting (a replay without its drafter model approximates a dynamic tree by the best static tree of the
same budget and depth); seeded or rejection sampling on a greedy replay uses greedy acceptance. The linear
backend and the gguf weight format act through their own measured verify and drafter curves; other weight
formats only through the profile they were measured with.
"""

from __future__ import annotations

from specpilot.core.costmodel import replay as rp
from specpilot.core.costmodel.profile import Profile, drafter_variant_key, interpolate, variant_key
from specpilot.core.engine.engine import tree_spec
from specpilot.core.engine.tree import static_prefixes
from specpilot.core.recipe import Recipe


def _levels(recipe: Recipe) -> list[int]:
    """Drafter forward widths per step: the root's pending token, then every level that has children."""
    spec = tree_spec(recipe)
    if spec.kind == "dynamic":
        return [1] + [spec.topk] * (spec.depth - 1)
    nodes = static_prefixes(spec.paths or [])
    parents = {p[:-1] for p in nodes if len(p) > 1}
    depth = max((len(p) for p in nodes), default=0)
    return [1] + [sum(1 for p in parents if len(p) == d) for d in range(1, depth)]


def on_backend(profile: Profile, kind: str, cost: dict, backend: str) -> dict:
    """A drafter's profiled costs with its forwards moved to `backend` (the drafter runs on the recipe's
    linear backend): each forward and the prompt prefill scaled by the ratio of the two backends' forward
    curves, timed interleaved; the per-call and per-level host work stays as profiled."""
    curves = profile.drafter_backend_curves
    rec = Recipe.from_dict(profile.recipe)
    profiled = drafter_variant_key(rec) if kind == "model" else variant_key(rec)  # only a model has a format
    if backend == profiled or kind not in curves.get(backend, {}) or kind not in curves.get(profiled, {}):
        return cost
    new, old = curves[backend][kind], curves[profiled][kind]

    def ratio(width: float) -> float:
        return interpolate(new, width) / max(interpolate(old, width), 1e-9)

    return {**cost, "curve": {w: ms * ratio(w) for w, ms in cost["curve"].items()},
            "prefill_ms": cost["prefill_ms"] * ratio(max(new))}


def drafter_cost(profile: Profile, recipe: Recipe) -> dict:
    """The profile's costs of the recipe's drafter on the recipe's linear backend. An early exit at a depth
    that was not measured is interpolated per layer between a measured early exit and the full target
    (below the measured depth: extrapolated, but never under the measured cost scaled by layers)."""
    backend = variant_key(recipe)
    if recipe.draft.method == "model":
        if "model" not in profile.drafters:
            raise ValueError("the profile has no measurements of a drafter model; profile a deployment with a "
                             "drafter checkpoint to predict draft.method = 'model'")
        return on_backend(profile, "model", profile.drafters["model"], drafter_variant_key(recipe))
    layers = recipe.draft.exit_layers(profile.target_layers)
    key = recipe.draft.drafter_key(profile.target_layers)
    if key in profile.drafters:
        return on_backend(profile, key, profile.drafters[key], backend)
    measured = [k for k in profile.drafters if k.startswith("early_exit:")]
    if not measured:
        raise ValueError("the profile has no early-exit measurements; profile with an early_exit recipe")
    base = on_backend(profile, measured[0], profile.drafters[measured[0]], backend)
    target = profile.verify_curve_for(backend)
    e0, full = int(measured[0].split(":")[1]), profile.target_layers
    frac = (layers - e0) / (full - e0)
    floor = min(1.0, layers / e0)
    curve = {w: max(ms + frac * (interpolate(target, w) - ms), ms * floor)
             for w, ms in base["curve"].items()}
    prefill = base["prefill_ms"] * max(1 + frac * (full / e0 - 1), floor)
    return {**base, "curve": curve, "prefill_ms": prefill}


def _draft_model(profile: Profile, recipe: Recipe) -> tuple[float, float]:
    """Microbenchmark-modelled draft ms per step and prompt prefill ms of a model/early-exit recipe."""
    spec = tree_spec(recipe)
    cost = drafter_cost(profile, recipe)
    draft = cost["fixed_ms"] + sum(cost["level_ms"] + interpolate(cost["curve"], w) for w in _levels(recipe))
    if spec.kind == "dynamic":
        draft += cost["dynamic"]["extra_ms_per_level"] * spec.depth
    return max(draft, 1e-6), cost["prefill_ms"]


def load_factors(profile: Profile) -> dict[str, float]:
    """Measured / modelled cost of the profiled recipe's verify and draft phases.

    Microbenchmarks give the shape of the costs; the timed run gives their level under the machine's load
    at the time (on a shared CPU the two differ by up to 2x). Draft falls back to the verify factor when
    the profiled recipe drafts without a model.
    """
    ph = profile.phases
    verify = ph["verify_ms"] / max(interpolate(profile.verify_curve, profile.nodes_per_step), 1e-6)
    factors = {"verify": verify, "draft": verify}
    incumbent = Recipe.from_dict(profile.recipe)
    if incumbent.draft.method != "ngram" and profile.steps:
        try:
            modelled, prefill = _draft_model(profile, incumbent)
        except ValueError:
            return factors
        measured = (ph["draft_ms"] * profile.steps - profile.requests * prefill) / profile.steps
        if measured > 0:
            factors["draft"] = measured / modelled
    return factors


def predict_detail(profile: Profile | dict, replay: rp.Replay, recipe: Recipe) -> dict:
    """The prediction with its parts: acceptance, per-step phase costs, per-request costs, tokens/s."""
    prof = profile if isinstance(profile, Profile) else Profile.from_dict(profile)
    kind = recipe.draft.method
    if replay.method != kind:
        raise ValueError(f"replay of the {replay.method!r} drafter cannot predict draft.method = "
                         f"{recipe.draft.method!r}; replay that drafter")
    spec = tree_spec(recipe)
    sim = rp.run(replay, spec)
    notes = []
    if spec.kind == "dynamic" and kind != "ngram" and replay.model is None:
        notes.append("dynamic tree approximated by the best static tree of the same budget and depth")
    if recipe.verify.sampling in ("seeded", "rejection"):
        notes.append(f"{recipe.verify.sampling} sampling approximated by greedy acceptance")
    ph = prof.phases
    factors = load_factors(prof)
    verify = interpolate(prof.verify_curve_for(variant_key(recipe)), sim.mean_nodes) * factors["verify"]
    if kind == "ngram":
        draft, prefill = sim.draft_ms, 0.0
    else:
        draft, prefill = (ms * factors["draft"] for ms in _draft_model(prof, recipe))
    step = draft + verify + ph["commit_ms"] + ph["host_ms"]
    per_request = prof.other_ms / max(prof.requests, 1) + prefill
    requests = len(replay.traces)
    total_ms = sim.steps * step + requests * per_request
    return {
        "tokens_per_s": 1e3 * sim.tokens / total_ms if total_ms > 0 else 0.0,
        "mean_accepted_length": sim.mean_accepted,
        "tokens_per_step": sim.tokens_per_step,
        "nodes_per_step": sim.mean_nodes,
        "step_ms": {"draft": draft, "verify": verify, "commit": ph["commit_ms"], "host": ph["host_ms"]},
        "per_request_ms": per_request,
        "load_factors": factors,
        "approximations": notes,
    }


def predict(profile: Profile | dict, replay: rp.Replay, recipe: Recipe) -> float:
    """Predicted tokens/s of `recipe` (batch 1) on the replayed requests; see the module docstring."""
    return predict_detail(profile, replay, recipe)["tokens_per_s"]
