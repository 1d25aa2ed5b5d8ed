"""What agents may ask the cost model: predictions, replayed acceptance and tree search for any recipe.

Everything is computed in the loop's process from trusted code (the engine, replay, profile, predict):
agents get numbers, never a handle on the models. The target's continuations are recorded once per
round and each drafter (the checkpoint, n-gram per lookup length, early exit per layer) is replayed on
them at most once, on first use, so a sweep over dozens of recipes costs simulations, not forwards.
Calls are serialised: agents run in parallel threads and share these caches.
"""

from __future__ import annotations

import threading
from typing import Any

from specpilot.core.costmodel import replay as rp
from specpilot.core.costmodel.predict import predict_detail
from specpilot.core.costmodel.profile import Profile, interpolate
from specpilot.core.engine.decode import Verification
from specpilot.core.engine.engine import tree_spec
from specpilot.core.engine.numerics import NumericsError, check_recipe as check_numerics
from specpilot.core.mechanisms import modelled
from specpilot.core.recipe import Recipe

EXTRA = 16  # tokens recorded past each request's end: deep enough for the deepest draft an agent sweeps


def drafter_key(recipe: Recipe, layers: int) -> str:
    """'model', 'ngram' or 'early_exit:E' (E resolved as the engine does)."""
    return recipe.draft.drafter_key(layers)


def numerics_refusal(numerics: str, recipe: Recipe) -> str | None:
    """check_recipe's one line when `numerics` refuses `recipe`'s target format or linear backend, else None."""
    try:
        check_numerics(numerics, recipe.weights.format, recipe.runtime.linear)
    except NumericsError as exc:
        return str(exc)
    return None


def _modelled(recipe: Recipe) -> Recipe:
    """Plugins are candidate code the loop never imports; model them with built-in stand-ins (a plugin tree
    policy as a depth-matched chain, a plugin draft length as the full depth), as the round's profile did."""
    return modelled(recipe)


class CostTools:
    """The cost model's answers for one round: built from the round's report on the incumbent."""

    def __init__(self, engine: Any, incumbent: Recipe, report: dict[str, Any], prompts: list[list[int]],
                 limits: list[int], request_ids: list[int] | None = None, batch_size: int = 1) -> None:
        self.engine = engine
        self.incumbent = incumbent
        self.report = report
        self.profile = Profile.from_dict(report["profile"])
        self.device = str(engine.device)
        self.batch_size = batch_size
        # the deployment's numerics (the engine's; the profile's for an engine that does not say)
        self.numerics = getattr(engine, "numerics", None) or self.profile.numerics
        self.layers = engine.target.cfg.num_layers
        self.drafters = (["model"] if engine.drafter_model is not None else []) + ["ngram"] + [
            f"early_exit:{e}" for e in range(1, self.layers)]
        self.bandwidth_gb_s = float(report["probe"]["bandwidth_gb_s"])
        self._prompts, self._limits, self._ids = prompts, limits, request_ids
        self._verification = Verification.of(incumbent.verify, speculative=False)
        self._traces: list[rp.Trace] | None = None
        self._replays: dict[tuple[str, int], rp.Replay] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_report(cls, engine: Any, incumbent: Recipe, report: dict[str, Any], prompts: list[list[int]],
                    limits: list[int], request_ids: list[int] | None = None, batch_size: int = 1) -> "CostTools":
        """Tools over a report the loop already has (no second profile run)."""
        return cls(engine, incumbent, report, prompts, limits, request_ids, batch_size)

    @classmethod
    def from_engine(cls, engine: Any, incumbent: Recipe, prompts: list[list[int]], limits: list[int],
                    request_ids: list[int] | None = None, batch_size: int = 1, **analyse_kwargs: Any) -> "CostTools":
        """Analyse the incumbent once (profile, replay, gaps), then answer agents from that."""
        from specpilot.core.costmodel.report import analyse

        report = analyse(engine, _modelled(incumbent), prompts, limits, request_ids, **analyse_kwargs)
        return cls(engine, incumbent, report, prompts, limits, request_ids, batch_size)

    # -- replays ----------------------------------------------------------------------------------------

    def _traces_once(self) -> list[rp.Trace]:
        if self._traces is None:
            self._traces = rp.record(self.engine.target, self._prompts, self._limits, EXTRA, self._verification,
                                     self._ids)
        return self._traces

    def replay(self, key: str, ngram_max: int = 3) -> rp.Replay:
        """The replay of drafter `key` (as in `drafters`), made on first use and kept for the round."""
        with self._lock:
            cache_key = (key, ngram_max if key == "ngram" else 0)
            if cache_key in self._replays:
                return self._replays[cache_key]
            if key not in self.drafters:
                raise ValueError(f"drafter {key!r} is not available here; available: {', '.join(self.drafters)}")
            traces = [rp.Trace(list(t.tokens), t.prompt_len, t.n_out, t.request_id) for t in self._traces_once()]
            if key == "ngram":
                made = rp.ngram_replay(traces, ngram_max)
            elif key == "model":
                drafter = self.engine.models_for(_modelled(self.incumbent))[1]  # a plugin incumbent: stand-ins
                made = rp.teacher_force(drafter, traces, "model", self._verification)
            else:
                layers = int(key.split(":")[1])
                made = rp.teacher_force(self.engine.target.truncated(layers), traces, "early_exit", self._verification)
            self._replays[cache_key] = made
            return made

    def _replay_for(self, recipe: Recipe) -> rp.Replay:
        return self.replay(drafter_key(recipe, self.layers), recipe.draft.ngram_max)

    # -- what agents ask --------------------------------------------------------------------------------

    def detail(self, recipe: Recipe) -> dict[str, Any]:
        """predict_detail for `recipe`: tokens/s, acceptance, nodes and per-step phase ms."""
        recipe = _modelled(recipe.validate())
        with self._lock:
            return predict_detail(self.profile, self._replay_for(recipe), recipe)

    def predict(self, recipe: Recipe) -> float:
        """Predicted tokens/s of `recipe` at batch 1 on the tuning requests."""
        return self.detail(recipe)["tokens_per_s"]

    def accepted(self, recipe: Recipe) -> float:
        """Replayed mean accepted length per step (bonus token counted) of `recipe` on the same guesses."""
        recipe = _modelled(recipe.validate())
        with self._lock:
            return rp.run(self._replay_for(recipe), tree_spec(recipe)).mean_accepted

    def best_tree(self, budget: int, max_depth: int, drafter: str | None = None) -> list[list[int]]:
        """Rank paths of the best replayed tree of <= budget nodes and <= max_depth levels for `drafter`
        (default: the incumbent's)."""
        key = drafter or drafter_key(self.incumbent, self.layers)
        with self._lock:
            return rp.best_tree(self.replay(key, self.incumbent.draft.ngram_max), budget, max_depth)

    def refused(self, recipe: Recipe) -> str | None:
        """Why the deployment's numerics refuse `recipe` (a target weight format or linear backend that would
        change the target's products; core/engine/numerics.check_recipe), or None when they allow it."""
        return numerics_refusal(self.numerics, recipe)

    def step_ms(self, recipe: Recipe) -> dict[str, float]:
        """Predicted ms per step by phase: draft, verify, commit, host."""
        return dict(self.detail(recipe)["step_ms"])

    def verify_ms(self, nodes: int) -> float:
        """The target's measured forward ms for `nodes` tokens verified at once (interpolated)."""
        return interpolate(self.profile.verify_curve, nodes)

    @property
    def weight_ms(self) -> float:
        """ms to read the target's weights once at the measured bandwidth: the memory-bound part of a step."""
        return 1e3 * self.profile.bytes["weights"] / (self.bandwidth_gb_s * 1e9)
