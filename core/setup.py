"""What a run prepares once: tokenised tuning and held-out requests, the forcing reference, the in-process
engine for the cost model (trusted code only), and the tools agents may ask."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from specpilot.core.deployment import Deployment
from specpilot.core.judge import JudgeRequest
from specpilot.core.recipe import Recipe


@dataclass
class RunContext:
    deployment: Deployment
    engine: Any
    reference: Any
    eos: list[int]
    tuning: list[JudgeRequest]
    heldout: list[JudgeRequest]
    ar_tokens_per_s: float = 0.0
    tuning_summary: dict = field(default_factory=dict)
    drift: dict | None = None  # the tuning requests' drift from transformers float32 (not f32), measured once
    _tools_factory: Callable | None = None

    def force(self, requests: list[JudgeRequest], outputs: list[list[int]], recipe: Recipe) -> dict:
        """Token forcing of `outputs` against the deployment's reference (transformers at f32, our own plain
        decoding under other numerics), in the judge's process."""
        from specpilot.core.forcing import force, reference_verification

        result = force(self.reference, [r.prompt for r in requests], outputs, [r.max_new_tokens for r in requests],
                       reference_verification(recipe), [r.index for r in requests], self.eos)
        return result.to_dict()

    def analyse(self, recipe: Recipe) -> dict:
        """The round's cost report for the incumbent on the tuning requests. Under numerics other than f32 it
        carries the drift of the deployment's plain decoding from transformers float32, measured in the first
        round and reused after (the numerics and the requests fix it; a recipe cannot change it)."""
        from specpilot.core.costmodel.report import analyse

        prompts = [r.prompt for r in self.tuning]
        limits = [r.max_new_tokens for r in self.tuning]
        report = analyse(self.engine, _materialised(recipe), prompts, limits, [r.index for r in self.tuning],
                         drift=self.drift if self.drift is not None else True)
        self.drift = report.get("drift")
        return report

    def tools_for(self, report: dict, recipe: Recipe) -> Any:
        """The cost model agents may ask what a change to `recipe` would do (a CostTools, or None when the
        cost model cannot be imported); built from that recipe's report, so a new incumbent needs new ones."""
        return self._tools_factory(report, recipe) if self._tools_factory is not None else None


def _materialised(recipe: Recipe) -> Recipe:
    """Plugins are candidate code: the loop's process never imports them, so the cost model profiles such an
    incumbent with built-in stand-ins (a plugin tree policy as a depth-matched chain, and so on)."""
    from specpilot.core.mechanisms import modelled

    return modelled(recipe)


def prepare(deployment: Deployment, max_requests: int | None = None, max_new_tokens: int | None = None,
            seed: int = 0) -> RunContext:
    """Load everything a run needs once; bad paths and files fail here with one clear line."""
    from transformers import AutoTokenizer

    from specpilot.core.costmodel.profile import timed_run
    from specpilot.core.engine import Engine
    from specpilot.core.engine.decode import misfit
    from specpilot.core.forcing import load_reference
    from specpilot.core.workload import encode, load, split

    deployment.apply_threads()
    engine = Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                         deployment.numerics)
    tokenizer = AutoTokenizer.from_pretrained(deployment.target)
    requests = load(deployment.workload)
    index = {r.id: i for i, r in enumerate(requests)}

    def prepared(which: str) -> list[JudgeRequest]:
        chosen = split(requests, which, seed)[: max_requests or None]
        return [JudgeRequest(r.id, index[r.id], encode(tokenizer, r), max_new_tokens or r.max_new_tokens)
                for r in chosen]

    tuning, heldout = prepared("tuning"), prepared("heldout")
    ctx_limit = engine.target.cfg.max_position_embeddings
    for r in tuning + heldout:
        if why := misfit(len(r.prompt), r.max_new_tokens, ctx_limit, "--max-new-tokens"):
            raise ValueError(f"request {r.id}: {why}")
    reference = load_reference(deployment.target, "float32", deployment.device, engine)
    ar = timed_run(engine, None, [r.prompt for r in tuning], [r.max_new_tokens for r in tuning],
                   [r.index for r in tuning])
    ar_tps = ar.new_tokens / sum(ar.seconds) if sum(ar.seconds) > 0 else 0.0
    summary = {"requests": len(tuning), "mean_prompt_tokens": sum(len(r.prompt) for r in tuning) / max(1, len(tuning)),
               "max_new_tokens": max((r.max_new_tokens for r in tuning), default=0),
               "ar_tokens_per_s": ar_tps}
    ctx = RunContext(deployment, engine, reference, engine.target.cfg.eos_token_ids, tuning, heldout, ar_tps,
                     tuning_summary=summary)
    ctx._tools_factory = _tools_factory(ctx)
    return ctx


def _tools_factory(ctx: RunContext) -> Callable | None:
    try:
        from specpilot.core.costmodel.tools import CostTools
    except ImportError:
        return None

    def make(report: dict, recipe: Recipe):
        return CostTools.from_report(ctx.engine, recipe, report, [r.prompt for r in ctx.tuning],
                                     [r.max_new_tokens for r in ctx.tuning], [r.index for r in ctx.tuning])
    return make
