"""Predicted tokens/s of any recipe from a profile and a replay, before the recipe is run.

Step time = draft + verify + commit/host:
  draft   model/early-exit drafters: per-call host work + per level (host work + a forward of that level's
          width), from the profile's drafter curves and real draft() timings; the drafter's prompt prefill
          once per request. Early exit without its own curve: the target's curve scaled by E / layers.
          n-gram: the lookup time measured while replaying it.
  verify  the target's cost curve at the mean nodes per step, plus the incumbent's measured verify work
          beyond its forward (choices, masks).
  commit/host  the incumbent's measured means.
Acceptance comes from the replay: exact for chains and static trees; dynamic model trees are approximated by
the best static tree of the same budget and depth (an adaptive tree can do better, so this errs low);
seeded or rejection sampling on a greedy replay uses greedy acceptance. Weight format and runtime options
act only through the profile they were measured with.
"""

from __future__ import annotations

from core.costmodel import replay as rp
from core.costmodel.profile import Profile, interpolate
from core.engine.engine import tree_spec
from core.engine.tree import static_prefixes
from core.recipe import Recipe


def _levels(recipe: Recipe) -> list[int]:
    """Drafter forward widths per step: the root's pending token, then every level that has children."""
    spec = tree_spec(recipe)
    if spec.kind == "dynamic":
        return [1] + [spec.topk] * (spec.depth - 1)
    nodes = static_prefixes(spec.paths or [])
    parents = {p[:-1] for p in nodes if len(p) > 1}
    depth = max((len(p) for p in nodes), default=0)
    return [1] + [sum(1 for p in parents if len(p) == d) for d in range(1, depth)]


def _replay_kind(recipe: Recipe) -> str:
    return {"model": "model", "early_exit": "early_exit", "ngram": "ngram"}[recipe.draft.method]


def _forward(profile: Profile, recipe: Recipe, width: float) -> float:
    """Drafter forward ms at `width` nodes for this recipe's drafter."""
    if recipe.draft.method == "early_exit":
        layers = recipe.draft.exit_layer or profile.target_layers // 2
        if profile.drafter == f"early_exit:{layers}":
            return interpolate(profile.draft_curve, width)
        return interpolate(profile.verify_curve, width) * layers / profile.target_layers
    if profile.drafter != "model":
        raise ValueError("the profile has no measurements of a drafter model; profile a deployment with a "
                         "drafter checkpoint to predict draft.method = 'model'")
    return interpolate(profile.draft_curve, width)


def _prefill(profile: Profile, recipe: Recipe) -> float:
    if recipe.draft.method == "early_exit" and not profile.drafter.startswith("early_exit"):
        layers = recipe.draft.exit_layer or profile.target_layers // 2
        return interpolate(profile.verify_curve, profile.prompt_len) * layers / profile.target_layers
    return profile.drafter_prefill_ms


def predict_detail(profile: Profile | dict, replay: rp.Replay, recipe: Recipe) -> dict:
    """The prediction with its parts: acceptance, per-step phase costs, per-request costs, tokens/s."""
    prof = profile if isinstance(profile, Profile) else Profile.from_dict(profile)
    kind = _replay_kind(recipe)
    if replay.method != kind:
        raise ValueError(f"replay of the {replay.method!r} drafter cannot predict draft.method = "
                         f"{recipe.draft.method!r}; replay that drafter")
    spec = tree_spec(recipe)
    sim = rp.run(replay, spec)
    notes = []
    if spec.kind == "dynamic" and kind != "ngram":
        notes.append("dynamic tree approximated by the best static tree of the same budget and depth")
    if recipe.verify.sampling in ("seeded", "rejection"):
        notes.append(f"{recipe.verify.sampling} sampling approximated by greedy acceptance")
    ph = prof.phases
    verify_extra = max(0.0, ph["verify_ms"] - interpolate(prof.verify_curve, prof.nodes_per_step))
    verify = interpolate(prof.verify_curve, sim.mean_nodes) + verify_extra
    if kind == "ngram":
        draft, prefill = sim.draft_ms, 0.0
    else:
        draft = prof.draft_fixed_ms + sum(prof.draft_level_ms + _forward(prof, recipe, w) for w in _levels(recipe))
        if spec.kind == "dynamic":
            draft += prof.draft_dynamic.get("extra_ms_per_level", 0.0) * spec.depth
        prefill = _prefill(prof, recipe)
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
        "approximations": notes,
    }


def predict(profile: Profile | dict, replay: rp.Replay, recipe: Recipe) -> float:
    """Predicted tokens/s of `recipe` (batch 1) on the replayed requests; see the module docstring."""
    return predict_detail(profile, replay, recipe)["tokens_per_s"]
