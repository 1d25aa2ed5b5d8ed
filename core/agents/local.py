"""Offline agents, one per kind of gap: each asks the cost model (`ctx.tools`, a CostTools) what a change
would buy, streams what it evaluated as it goes, and proposes the best change or says why none pays.

They never touch the held-out requests or run the target: every number comes from the replayed acceptance
and the measured profile, so a round stays cheap and an agent's claim can be checked against the judge's
measurement. They are deterministic given the context; `ctx.seed` only breaks exact ties.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from core.agents.base import AgentContext, AgentFailure, Candidate
from core.diffs import RECIPE_FILE, make_unified_diff
from core.deployment import Deployment
from core.engine.tree import static_prefixes
from core.memory import apply_fragment, applicable, effect_of, rejection_line, rejection_of, remembered_plugins
from core.recipe import LINEAR_BACKENDS, Recipe, RecipeError

MIN_GAIN = 0.01  # below this the judge's noise floor swallows the change: not worth a timing slot
BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)
DYNAMIC_SHAPES = ((16, 6), (32, 6), (64, 8))  # (budget, depth); EAGLE-2 style, topk 4
# where verifying 33 tokens costs <= KNEE x one (a matrix unit, a GPU): wider and deeper shapes, and deeper chains
FLAT_SHAPES = ((8, 4), (16, 8), (24, 8), (32, 8), (32, 10), (32, 12))
FLAT_CHAINS = (6, 8, 10, 12)
MAX_DEPTH = 8
CHAIN_DEPTHS = tuple(range(1, 11))
NGRAM_DEPTHS = tuple(range(1, 13))
NGRAM_MAX = (1, 2, 3, 4, 5)
PACKED_BYTES = 12 / 16
KNEE = 1.25  # a node budget stays on the flat (memory-bound) part while verify costs <= 1.25x one token per row
CURVE_POINTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class Option:
    """One recipe an agent considered, with what the cost model predicts for it."""

    label: str
    recipe: Recipe
    accepted: float
    predicted: float


class Stream:
    """Writes an agent's progress to on_chunk as it happens: whole lines, or pieces of one line."""

    def __init__(self, on_chunk: Callable[[str], None]) -> None:
        self.on_chunk = on_chunk

    def __call__(self, line: str) -> None:
        self.on_chunk(line + "\n")

    def part(self, text: str) -> None:
        self.on_chunk(text)


def pct(value: float, base: float) -> str:
    return f"{value / base - 1:+.1%}" if base > 0 else "n/a"


def evaluate(tools: Any, label: str, recipe: Recipe) -> Option:
    """Validate `recipe` and ask the cost model for its replayed acceptance and predicted speed."""
    recipe.validate()
    return Option(label, recipe, tools.accepted(recipe), tools.predict(recipe))


def best_of(options: list[Option], seed: int) -> Option:
    """The fastest predicted option; exact ties go to a seeded draw so a seed fully determines the choice."""
    rng = random.Random(seed)
    keyed = [(o.predicted, rng.random(), o) for o in options]
    return max(keyed, key=lambda k: (k[0], k[1]))[2]


def tree_label(recipe: Recipe) -> str:
    t = recipe.tree
    if t.policy == "chain":
        return f"chain {t.depth}"
    if t.policy == "static":
        return f"static tree ({len(static_prefixes(t.paths))} nodes, depth {max(len(p) for p in t.paths)})"
    if t.policy == "dynamic":
        return f"dynamic tree (budget {t.budget}, depth {t.depth}, topk {t.topk})"
    return t.policy


def drafter_key(recipe: Recipe, drafters: list[str]) -> str:
    """'model', 'ngram' or 'early_exit:E': the names CostTools.drafters uses (the target has one more
    layer than the last exit listed)."""
    exits = [int(k.split(":")[1]) for k in drafters if k.startswith("early_exit:")]
    return recipe.draft.drafter_key(max(exits, default=1) + 1)


def with_drafter(recipe: Recipe, key: str) -> Recipe:
    method, _, layer = key.partition(":")
    return recipe.replace(draft={"method": method, "exit_layer": int(layer) if layer else 0})


def static_tree(recipe: Recipe, paths: list[list[int]], budget: int) -> Recipe:
    return recipe.replace(tree={"policy": "static", "paths": [list(p) for p in paths], "budget": budget,
                                "depth": max(len(p) for p in paths)})


class LocalAgent:
    """Shared plumbing: checks for tools, turns agent-side errors into failures, builds the candidate."""

    default_name = "local"
    needs_tools = True

    def __init__(self, name: str | None = None, seed: int = 0) -> None:
        self.name = name or self.default_name
        self.seed = seed

    def propose(self, ctx: AgentContext, on_chunk: Callable[[str], None]) -> Candidate | AgentFailure:
        if self.needs_tools and ctx.tools is None:
            return AgentFailure(self.name, "no cost model in the context (ctx.tools is None); local agents predict "
                                           "every change with CostTools before proposing it")
        try:
            return self.search(ctx, ctx.tools, Stream(on_chunk))
        except Exception as exc:  # an agent-side problem is a failed candidate, never the loop's crash
            return AgentFailure(self.name, f"{type(exc).__name__}: {exc}")

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        raise NotImplementedError

    def tie_seed(self, ctx: AgentContext) -> int:
        return ctx.seed * 1_000_003 + self.seed

    def finish(self, ctx: AgentContext, base: Option, options: list[Option], what: str, say: Stream,
               rationale: str) -> Candidate | AgentFailure:
        """Propose the best option if it clears MIN_GAIN over the incumbent, else fail saying how close it got."""
        inc_toml = ctx.recipe.to_toml()
        options = [o for o in options if o.recipe.to_toml() != inc_toml]
        for o in [o for o in options if rejection_of(o.recipe, ctx.recipe, ctx.rejected)]:
            say(f"not proposing {o.label}: it repeats {rejection_line(rejection_of(o.recipe, ctx.recipe, ctx.rejected))}")
            options.remove(o)
        if not options:
            return AgentFailure(self.name, f"no {what} differs from the incumbent")
        best = best_of(options, self.tie_seed(ctx))
        if best.predicted < base.predicted * (1 + MIN_GAIN):
            return AgentFailure(self.name, f"no {what} predicted above the incumbent (best: {best.label}, "
                                           f"{pct(best.predicted, base.predicted)})")
        speedup = best.predicted / base.predicted
        say(f"proposing {best.label}: {best.accepted:.2f} tokens/step, predicted {best.predicted:.0f} tok/s vs "
            f"{base.predicted:.0f} ({speedup:.3f}x)")
        return self.candidate(ctx, best.recipe, best.label, rationale.format(best=best, base=base, speedup=speedup),
                              speedup, say)

    def plugin_candidate(self, inc: Recipe, new: Recipe, name: str, source: str, title: str, rationale: str,
                         speedup: float, say: Stream) -> Candidate:
        """A candidate that adds workspace plugin `plugins/<name>.py` and the recipe change selecting it."""
        path = f"plugins/{name}.py"
        diff = make_unified_diff("", source, path) + make_unified_diff(inc.to_toml(), new.to_toml(), RECIPE_FILE)
        say.part(diff)
        return Candidate(agent=self.name, title=title, rationale=rationale, kind="recipe+plugin", diff=diff,
                         recipe=new, files={path: source}, predicted_speedup=speedup)

    def candidate(self, ctx: AgentContext, new: Recipe, title: str, rationale: str, speedup: float | None,
                  say: Stream) -> Candidate:
        new.validate()
        diff = make_unified_diff(ctx.recipe.to_toml(), new.to_toml(), RECIPE_FILE)
        say.part(diff)
        return Candidate(agent=self.name, title=title[:120], rationale=rationale, kind="recipe", diff=diff,
                         recipe=new, predicted_speedup=speedup)


class TreeShapeAgent(LocalAgent):
    """Acceptance gap: the best static tree per node budget from replay, plus dynamic trees; fastest wins."""

    default_name = "tree-shape"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        base = evaluate(tools, "incumbent", inc)
        say(f"incumbent {tree_label(inc)}: {base.accepted:.2f} tokens/step, predicted {base.predicted:.0f} tok/s")
        options = []
        for budget in BUDGETS:
            paths = tools.best_tree(budget, min(budget, MAX_DEPTH))
            o = evaluate(tools, f"best {budget}-node static tree", static_tree(inc, paths, budget))
            say(f"best {budget}-node tree (depth {o.recipe.tree.depth}): {o.accepted:.2f} tokens/step, "
                f"predicted {o.predicted:.0f} tok/s ({pct(o.predicted, base.predicted)})")
            options.append(o)
        one, wide = max(tools.verify_ms(1), 1e-9), tools.verify_ms(33)
        flat = wide <= KNEE * one
        say(f"verify curve: 33 tokens cost {wide / one:.2f}x one" + (
            f" (<= {KNEE:.2f}x: flat, so wider and deeper trees and deeper chains are worth pricing)" if flat else ""))
        for budget, depth in DYNAMIC_SHAPES + (FLAT_SHAPES if flat else ()):
            recipe = inc.replace(tree={"policy": "dynamic", "budget": budget, "depth": depth, "topk": 4, "paths": []})
            o = evaluate(tools, f"dynamic tree (budget {budget}, depth {depth})", recipe)
            say(f"dynamic budget {budget} depth {depth}: {o.accepted:.2f} tokens/step, predicted "
                f"{o.predicted:.0f} tok/s ({pct(o.predicted, base.predicted)})")
            options.append(o)
        for depth in FLAT_CHAINS if flat else ():
            o = evaluate(tools, f"chain depth {depth}", inc.replace(tree={"policy": "chain", "depth": depth,
                                                                          "paths": []}))
            say(f"chain depth {depth}: {o.accepted:.2f} tokens/step, predicted {o.predicted:.0f} tok/s "
                f"({pct(o.predicted, base.predicted)})")
            options.append(o)
        return self.finish(ctx, base, options, f"tree within budget {max(BUDGETS)}", say,
                           "On the same drafter guesses, this shape locks in {best.accepted:.2f} tokens per verify "
                           "step vs {base.accepted:.2f} for the incumbent; with the measured verify cost curve the "
                           "cost model predicts {speedup:.3f}x.")


class DraftLengthAgent(LocalAgent):
    """Acceptance/drafting gap: how far to draft (chain depth, dynamic depth, static depth cap, n-gram length)."""

    default_name = "draft-length"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        base = evaluate(tools, "incumbent", inc)
        say(f"incumbent {tree_label(inc)}: {base.accepted:.2f} tokens/step, predicted {base.predicted:.0f} tok/s")
        policy = inc.tree.policy
        if policy == "chain":
            depths = NGRAM_DEPTHS if inc.draft.method == "ngram" else CHAIN_DEPTHS
            options = self.sweep(tools, say, "chain depths", depths,
                                 lambda d: (f"chain depth {d}", inc.replace(tree={"depth": d})))
        elif policy == "dynamic":
            options = self.sweep(tools, say, "dynamic depths", tuple(range(2, 11)),
                                 lambda d: (f"dynamic depth {d}", inc.replace(tree={"depth": d})))
        elif policy == "static":
            nodes = _nodes(inc)
            options = self.sweep(tools, say, f"best {nodes}-node trees capped at depths", tuple(range(1, 13)),
                                 lambda d: (f"{nodes}-node tree capped at depth {d}",
                                            static_tree(inc, tools.best_tree(nodes, d), nodes)))
        else:
            return AgentFailure(self.name, f"tree.policy {policy!r} is a plugin; its draft length is the plugin's")
        if inc.draft.method == "ngram" and options:
            at = best_of(options, self.tie_seed(ctx))
            lengths = self.sweep(tools, say, f"n-gram lookup lengths at {tree_label(at.recipe)}", NGRAM_MAX,
                                 lambda n: (f"{tree_label(at.recipe)}, n-gram max {n}",
                                            at.recipe.replace(draft={"ngram_max": n})))
            # a second knob moves only for a gain the judge could see, not for a prediction's rounding
            options += [o for o in lengths if o.predicted >= at.predicted * (1 + MIN_GAIN)]
        return self.finish(ctx, base, options, "draft length", say,
                           "Replayed acceptance flattens with depth while each extra level costs a drafter call and "
                           "wider verification; {best.label} is where predicted tokens/s peaks ({speedup:.3f}x).")

    @staticmethod
    def sweep(tools: Any, say: Stream, what: str, values: tuple[int, ...],
              make: Callable[[int], tuple[str, Recipe]]) -> list[Option]:
        say.part(f"replaying {what} {values[0]}..{values[-1]}:")
        options = []
        for v in values:
            label, recipe = make(v)
            options.append(evaluate(tools, label, recipe))
            say.part(f" {options[-1].accepted:.2f}")
        say("")
        say("predicted tok/s: " + " ".join(f"{o.predicted:.0f}" for o in options))
        return options


class DrafterChoiceAgent(LocalAgent):
    """Drafting gap: model vs n-gram vs early exit at each exit layer, each with its best chain and the
    incumbent's shape."""

    default_name = "drafter-choice"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        current = drafter_key(inc, tools.drafters)
        base = evaluate(tools, "incumbent", inc)
        say(f"drafters available: {', '.join(tools.drafters)}; incumbent {current} with {tree_label(inc)}: "
            f"{base.accepted:.2f} tokens/step, predicted {base.predicted:.0f} tok/s")
        options = []
        for key in tools.drafters:
            if key == current:
                continue
            try:
                shaped = with_drafter(inc, key).validate()
            except RecipeError as exc:
                say(f"{key}: skipped ({exc})")
                continue
            depths = NGRAM_DEPTHS if key == "ngram" else CHAIN_DEPTHS
            tried = [evaluate(tools, f"{key} drafter, {tree_label(shaped)}", shaped)]
            tried += [evaluate(tools, f"{key} drafter, chain {d}",
                               shaped.replace(tree={"policy": "chain", "depth": d, "paths": []})) for d in depths]
            best = best_of(tried, self.tie_seed(ctx))
            say(f"{key}: best {best.label.split(', ', 1)[1]}: {best.accepted:.2f} tokens/step, predicted "
                f"{best.predicted:.0f} tok/s ({pct(best.predicted, base.predicted)})")
            options.append(best)
        return self.finish(ctx, base, options, "other drafter", say,
                           "Replaying each drafter on the recorded outputs: {best.label} accepts {best.accepted:.2f} "
                           "tokens/step; with its measured draft cost the cost model predicts {speedup:.3f}x.")


class DrafterFormatAgent(LocalAgent):
    """Drafting gap: the drafter model's products in approximate 8- or 4-bit blocks (weights.drafter_format,
    kernels/cpu/q8_draft.c), priced on the profile's measured drafter curves in each format. A drafter only
    proposes, so the output cannot change; its acceptance can, which the prediction holds at the profiled
    rate and the judge measures on held-out requests."""

    default_name = "drafter-format"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        from core.costmodel.profile import variant_key

        inc = ctx.recipe
        if inc.draft.method != "model":
            return AgentFailure(self.name, f"the incumbent drafts with {inc.draft.method!r}, not a drafter model: "
                                           "no drafter weights to format")
        curves = tools.profile.drafter_backend_curves
        key = variant_key(inc)
        base = evaluate(tools, f"drafter format {inc.weights.drafter_format}", inc)
        mine = curves.get(key if inc.weights.drafter_format == "same" else f"{key}+{inc.weights.drafter_format}",
                          {}).get("model", {})
        options = []
        for form in ("q8", "q4"):
            measured = curves.get(f"{key}+{form}", {}).get("model")
            if form == inc.weights.drafter_format or not measured:
                continue
            points = ", ".join(f"{w} rows {measured[w]:.1f} vs {mine[w]:.1f} ms" for w in sorted(measured) if w in mine)
            say(f"drafter forward in {form} blocks vs {inc.weights.drafter_format}: {points}")
            option = evaluate(tools, f"drafter in {form} blocks", inc.replace(weights={"drafter_format": form}))
            say(f"{form}: predicted {option.predicted:.0f} tok/s ({pct(option.predicted, base.predicted)}) at the "
                "profiled acceptance")
            options.append(option)
        if not options:
            return AgentFailure(self.name, f"the profile measured no other drafter format on {key}")
        rationale = ("The drafter only proposes tokens the target verifies, so its products may be approximate "
                     "without changing the output: {best.label} cuts its measured forward, predicted x{speedup:.3f} "
                     "if acceptance holds (the judge measures it).")
        return self.finish(ctx, base, options, "drafter format", say, rationale)

    @staticmethod
    def fits_report(report: dict[str, Any] | None) -> bool:
        """Wherever the profile measured a drafter model whose one-row forward an approximate format makes at
        least 10% cheaper (a tiny drafter, bound by per-op overhead, gains nothing from fewer bytes)."""
        curves = ((report or {}).get("profile") or {}).get("drafter_backend_curves") or {}

        def one_row(key: str) -> float | None:
            curve = (curves.get(key) or {}).get("model") or {}
            return curve.get(1, curve.get("1"))

        for key in curves:
            if "+" in key:
                mine, base = one_row(key), one_row(key.split("+")[0])
                if mine is not None and base and mine < 0.9 * base:
                    return True
        return False


class WeightFormatAgent(LocalAgent):
    """Weights and verify gaps: read the checkpoint's own GGUF blocks (exact, a quarter of float32's bytes on
    a Q4_K model), priced on the profile's measured gguf forward curves; else packed12, which reads 12/16 of
    the bytes and pays only where verify is memory-bound and the fused kernel exists (CUDA)."""

    default_name = "weight-format"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        curves = tools.profile.backend_curves
        if inc.weights.format == "gguf":
            return AgentFailure(self.name, "the weights are already read as stored (gguf): no exact format reads "
                                           "fewer bytes")
        if "gguf" in curves:
            return self.gguf(ctx, tools, say, curves)
        if inc.weights.format == "packed12":
            return AgentFailure(self.name, "weights are already packed12; no other lossless format to try")
        base_pred = tools.predict(inc)
        step = tools.step_ms(inc)
        total = sum(step.values())
        verify = step["verify"]
        bound = min(tools.weight_ms, verify)
        say(f"step {total:.2f} ms: verify {verify:.2f} ms, of which reading the target's weights at the measured "
            f"bandwidth is {bound:.2f} ms ({bound / verify:.0%})" if verify > 0 else f"step {total:.2f} ms")
        if not str(tools.device).startswith("cuda"):
            say(f"on {tools.device} packed12 decodes to bf16 and runs the dense matmul: verify still reads 16/16 "
                "of the weight bytes, plus a wrapper call per linear")
            return AgentFailure(self.name, f"packed12 on {tools.device} is a correctness path (decode then matmul): "
                                           "verify still reads 16/16 of the weight bytes plus extra dispatch per "
                                           "linear, so it predicts a slowdown (x1.00 at best); it pays only with the "
                                           "fused CUDA kernel")
        saved = bound * (1 - PACKED_BYTES)
        speedup = total / (total - saved) if total > saved else 1.0
        predicted = base_pred * speedup
        say(f"packed12 reads 12/16 of those bytes: verify {verify:.2f} -> {verify - saved:.2f} ms/step, predicted "
            f"{predicted:.0f} tok/s ({pct(predicted, base_pred)}; {1 / PACKED_BYTES:.2f}x at most on the "
            "memory-bound part)")
        if speedup < 1 + MIN_GAIN:
            return AgentFailure(self.name, f"packed12 predicted {pct(predicted, base_pred)}: the verify step is not "
                                           "weight-bandwidth-bound enough to pay")
        new = inc.replace(weights={"format": "packed12"})
        rationale = (f"Verification reads every target weight once per step; {bound:.2f} of {verify:.2f} ms is that "
                     f"read at the measured bandwidth. Packed12 is lossless (bit-exact decode) and reads 12/16 of "
                     f"the bytes in the fused kernel: predicted {speedup:.3f}x.")
        return self.candidate(ctx, new, "packed12 target weights (12/16 of the verify bytes)", rationale, speedup, say)


    @staticmethod
    def fits_report(report: dict[str, Any] | None) -> bool:
        """packed12 pays only with the fused CUDA kernel; gguf wherever the profile measured the checkpoint's
        own blocks (a GGUF checkpoint, on any device)."""
        device = str(((report or {}).get("probe") or {}).get("device", "cpu"))
        curves = ((report or {}).get("profile") or {}).get("backend_curves") or {}
        return device.startswith("cuda") or "gguf" in curves

    def gguf(self, ctx: AgentContext, tools: Any, say: Stream, curves: dict) -> Candidate | AgentFailure:
        """Propose gguf weights for target and drafter when the measured curves predict a gain."""
        inc = ctx.recipe
        mine = tools.profile.verify_curve_for(inc.runtime.linear)
        points = ", ".join(f"{n} nodes {curves['gguf'][n]:.0f} vs {mine[n]:.0f} ms"
                           for n in (1, 4, 8, 16) if n in curves["gguf"] and n in mine)
        say(f"target forward, gguf blocks vs {inc.weights.format} weights on {inc.runtime.linear}: {points}")
        base = evaluate(tools, f"{inc.weights.format} weights", inc)
        option = evaluate(tools, "gguf weights (target and drafter)",
                          inc.replace(weights={"format": "gguf", "drafter": True}, runtime={"linear": "native"}))
        say(f"gguf: predicted {option.predicted:.0f} tok/s ({pct(option.predicted, base.predicted)})")
        rationale = ("The checkpoint's own GGUF blocks, dequantised exactly in the kernel, read far fewer bytes than "
                     "float32 weights, and a verify step reuses each block for every node (measured forward curve); "
                     "the values are the reference's bit for bit, so only near-ties can move: predicted "
                     "x{speedup:.3f}.")
        return self.finish(ctx, base, [option], "weight format", say, rationale)


class RuntimeAgent(LocalAgent):
    """Verify and dispatch gaps on a CPU: verification runs few-row GEMMs, where the default BLAS can be much
    slower than oneDNN's or SpecPilot's skinny kernel, and some 25 small ops per layer, which the fused layer
    runs in one C call; the profile measured the target's forward under every linear backend, so the choice
    is priced on this machine, not assumed."""

    default_name = "runtime"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        if inc.weights.format == "gguf":
            return AgentFailure(self.name, "the weights are read as stored (gguf), which runs its own block kernel "
                                           "on no linear backend: the runtime has nothing to change")
        curves = tools.profile.backend_curves
        mine = tools.profile.verify_curve_for(inc.runtime.linear)
        others = [b for b in curves if b in LINEAR_BACKENDS and b != inc.runtime.linear]
        if not others:
            measured = ", ".join(curves) or inc.runtime.linear
            return AgentFailure(self.name, f"no other linear backend runs here (measured: {measured}; onednn, "
                                           f"skinny and fused run on a CPU), so the runtime has nothing to change on "
                                           f"{tools.device}")
        base = evaluate(tools, f"linear {inc.runtime.linear}", inc)
        options = []
        for backend in others:
            points = ", ".join(f"{n} nodes {curves[backend][n]:.1f} vs {mine[n]:.1f} ms"
                               for n in (1, 4, 8, 16) if n in curves[backend] and n in mine)
            say(f"target forward, {backend} vs {inc.runtime.linear}: {points}")
            option = evaluate(tools, f"linear backend {backend}", inc.replace(runtime={"linear": backend}))
            say(f"linear = {backend}: predicted {option.predicted:.0f} tok/s ({pct(option.predicted, base.predicted)})")
            options.append(option)
        rationale = ("Verification's few-row GEMMs run faster under {best.label} on this CPU (measured forward "
                     "curve); the weights are the same numbers, so only floating-point near-ties can move: "
                     "predicted {speedup:.3f}x.")
        return self.finish(ctx, base, options, "linear backend", say, rationale)


class BatchingAgent(LocalAgent):
    """Batching gap: at batch > 1 every row drafting a full tree overflows the flat part of the verify curve;
    a shared node budget at the curve's knee keeps verification memory-bound."""

    default_name = "batching"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        batch = int(tools.batch_size)
        if batch <= 1:
            return AgentFailure(self.name, "batch size 1: no batching gap")
        inc = ctx.recipe
        base = evaluate(tools, "incumbent", inc)
        curve = {n: tools.verify_ms(n) for n in sorted({batch, *(n for n in CURVE_POINTS if n > batch)})}
        say("verify cost curve (tokens verified: ms): " + "  ".join(f"{n}: {ms:.2f}" for n, ms in curve.items()))
        knee = max(n for n, ms in curve.items() if ms <= KNEE * curve[batch])
        per_row = knee // batch - 1
        say(f"knee at {knee} tokens (verify <= {KNEE:.2f}x one token per row): {per_row} draft nodes per row "
            f"at batch {batch}")
        if per_row < 1:
            return AgentFailure(self.name, f"the verify curve's knee ({knee} tokens) leaves no draft node per row "
                                           f"at batch {batch}: nothing to share")
        fixed = self.throughput(tools, inc, batch, base.accepted, say, "fixed")
        shaped = static_tree(inc, tools.best_tree(per_row, min(per_row, MAX_DEPTH)), per_row)
        cut = cut_tree(inc, per_row)
        options = []
        for policy, shape in (("budget", shaped), ("cap", cut)):
            recipe = inc.replace(batching={"policy": policy, "node_budget": knee,
                                           "token_cap": per_row if policy == "cap" else 0})
            acc = tools.accepted(shape)
            predicted = base.predicted * self.throughput(tools, shape, batch, acc, say, policy) / fixed
            options.append(Option(f"batching {policy} ({knee} tokens per step)", recipe, acc, predicted))
            say(f"  predicted {predicted:.0f} tok/s ({pct(predicted, base.predicted)})")
        say("allocate: replay pools the rows, so it cannot tell allocate (nodes by row confidence) from budget; "
            "not proposed on a tie")
        tokens = batch * (_nodes(inc) + 1)
        where = "past" if tokens > knee else "below"
        return self.finish(ctx, base, options, "batching policy", say,
                           f"At batch {batch} per-row trees of {_nodes(inc)} nodes verify {tokens} tokens per step, "
                           f"{where} the knee of the verify cost curve ({knee} tokens); "
                           "{best.label} spends exactly the flat part of the curve: predicted {speedup:.3f}x.")

    @staticmethod
    def throughput(tools: Any, shape: Recipe, batch: int, accepted: float, say: Stream, label: str) -> float:
        """Tokens per ms for `batch` rows each drafting `shape`: the batch shares one draft and verify step."""
        step = tools.step_ms(shape)
        tokens = batch * (_nodes(shape) + 1)
        ms = step["draft"] + step.get("host", 0.0) + step.get("commit", 0.0) + tools.verify_ms(tokens)
        say(f"{label}: {batch} x {_nodes(shape)} nodes ({tokens} tokens verified), {accepted:.2f} tokens/row/step, "
            f"{ms:.2f} ms/step")
        return batch * accepted / ms


ADAPTIVE_WINDOWS = (1, 2, 3, 4)
ADAPTIVE_MARGINS = (0, 1, 2)
ADAPTIVE_TEMPLATE = '''"""Acceptance-adaptive draft length, written by the adaptive-length agent and fitted on the
tuning requests' replayed acceptance: draft the mean accepted tokens of the last {window} step(s) plus
{margin}, at most the tree's depth, so a stretch the drafter gets wrong costs short drafts and an easy one
keeps full depth."""

from core.mechanisms import register

WINDOW = {window}
MARGIN = {margin}


def length(depth: int, recent: list[int]) -> int:
    if not recent:
        return depth
    last = recent[-WINDOW:]
    return min(depth, round(sum(last) / len(last)) + MARGIN)


register("draft_length", "{name}", length)
'''


def adaptive_depth(depth: int, recent: list[int], window: int, margin: int) -> int:
    """What the written plugin computes (the same expression), for the agent's simulation."""
    if not recent:
        return depth
    last = recent[-window:]
    return max(1, min(depth, round(sum(last) / len(last)) + margin))


class AdaptiveLengthAgent(LocalAgent):
    """Drafting and host gaps, by writing code: a draft-length plugin that drafts short after steps the
    drafter got wrong and deep after ones it got right. Every step pays a fixed host and verify cost, so on
    easy stretches deeper drafts amortise it, and on hard ones shorter drafts stop paying for guesses that
    will be rejected. The plugin's window and margin (and the depth it may reach) are fitted by simulating
    it on the replayed acceptance of the tuning requests, priced with the measured per-depth step cost."""

    default_name = "adaptive-length"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        if inc.tree.policy != "chain":
            return AgentFailure(self.name, f"the adaptive draft length is fitted on a chain; the incumbent drafts "
                                           f"{tree_label(inc)}")
        if inc.draft.length != "fixed":
            return AgentFailure(self.name, f"draft.length is already {inc.draft.length!r}")
        deepest = max(MAX_DEPTH, inc.tree.depth)
        replay = tools.replay(drafter_key(inc, tools.drafters), inc.draft.ngram_max)
        if inc.draft.method == "ngram":
            runs = [_ngram_runs(t.tokens, t.prompt_len, t.n_out, inc.draft.ngram_max, deepest) for t in replay.traces]
        else:
            runs = [_rank0_runs(t.ranks, t.prompt_len, t.n_out, len(t.tokens) - 1) for t in replay.traces]
        cost = {c: sum(tools.step_ms(inc.replace(tree={"depth": c})).values()) for c in range(1, deepest + 1)}
        say("step ms by draft depth: " + " ".join(f"{c}: {ms:.2f}" for c, ms in cost.items()))

        def rate(rule: Callable[[int, list[int]], int], top: int) -> float:
            tokens = ms = 0.0
            for run, (start, n_out, last) in runs:
                i, emitted, recent = start, 0, []
                while emitted < n_out and i < last:
                    c = rule(top, recent)
                    d = min(run.get(i, 0), c, last - i - 1)
                    ms += cost[c]
                    recent.append(d + 1)
                    emitted += d + 1
                    i += d + 1
                tokens += n_out
            return tokens / ms if ms else 0.0

        base = rate(lambda top, recent: top, inc.tree.depth)
        best_fixed = max(range(1, deepest + 1), key=lambda d: rate(lambda top, recent: top, d))
        fixed_rate = rate(lambda top, recent: top, best_fixed)
        say(f"incumbent chain {inc.tree.depth}: {1e3 * base:.0f} tok/s simulated; best fixed depth {best_fixed}: "
            f"{1e3 * fixed_rate:.0f}")
        fits = []
        for top in range(2, deepest + 1):
            for w in ADAPTIVE_WINDOWS:
                for m in ADAPTIVE_MARGINS:
                    r = rate(lambda depth, recent, w=w, m=m: adaptive_depth(depth, recent, w, m), top)
                    fits.append((r, -top, -w, -m))
        r, top, w, m = max(fits)
        top, w, m = -top, -w, -m
        say(f"fitted: window {w}, margin {m}, depth up to {top}: {1e3 * r:.0f} tok/s simulated "
            f"({pct(r, base)} vs the incumbent, {pct(r, fixed_rate)} vs the best fixed depth)")
        if r < base * (1 + MIN_GAIN):
            return AgentFailure(self.name, f"no adaptive draft length predicted above the incumbent (best: window "
                                           f"{w}, margin {m}, depth {top}, {pct(r, base)})")
        name = f"adaptive_w{w}_m{m}"
        source = ADAPTIVE_TEMPLATE.format(window=w, margin=m, name=name)
        new = inc.replace(draft={"length": f"plugin:{name}"}, tree={"depth": top}).validate()
        speedup = r / base
        rationale = (f"Simulated on the replayed acceptance with the measured step cost per depth, drafting the mean "
                     f"of the last {w} step(s)' accepted tokens + {m} (at most {top}) gives {pct(r, base)} over "
                     f"chain {inc.tree.depth} and {pct(r, fixed_rate)} over the best fixed depth {best_fixed}.")
        return self.plugin_candidate(inc, new, name, source, f"Adaptive draft length plugin (window {w}, margin {m}, "
                                     f"depth {top})", rationale, speedup, say)


HYBRID_TEMPLATE = '''"""Two-level drafting, written by the hybrid-drafter agent and fitted on the tuning requests'
replay: draft by n-gram lookup (max n = the recipe's draft.ngram_max, to the tree's depth) when the context has a
match, and with the drafter model (to depth {model_depth}) when it has none. The model's cache catches up
on the tokens committed meanwhile at its next draft, so a lookup step costs no model forward."""

from core.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from core.mechanisms import register

MODEL_DEPTH = {model_depth}


class Hybrid(Drafter):
    def __init__(self, ngram, model):
        self.ngram, self.model = ngram, model

    def reset(self, prompts, max_len):
        self.ngram.reset(prompts, max_len)
        self.model.reset(prompts, max_len)

    def open(self, max_batch, max_len):
        self.ngram.open(max_batch, max_len)
        self.model.open(max_batch, max_len)

    def admit(self, prompt):
        self.ngram.admit(prompt)
        return self.model.admit(prompt)

    def move(self, src, dst):
        self.ngram.move(src, dst)
        self.model.move(src, dst)

    def drop_last(self):
        self.ngram.drop_last()
        self.model.drop_last()

    def draft(self, spec, mode, active):
        trees = self.ngram.draft(spec, mode, active)
        if all(len(t) > 1 for t, a in zip(trees, active) if a):
            return trees
        return self.model.draft(spec.shortened(MODEL_DEPTH), mode, active)

    def commit(self, rows, paths, tokens):
        self.ngram.commit(rows, paths, tokens)
        self.model.commit(rows, paths, tokens)


def build(engine, recipe, target, drafter_model):
    if drafter_model is None:
        raise ValueError("the hybrid drafter needs a drafter checkpoint (--drafter DIR)")
    return Hybrid(NgramDrafter(recipe.draft.ngram_max), ModelDrafter(drafter_model))


register("drafter", "{name}", build)
'''


class HybridDrafterAgent(LocalAgent):
    """Drafting and acceptance gaps, by writing code: a drafter plugin that drafts by n-gram lookup where the
    context has a match (nearly free, long when it hits) and with the drafter model where it has none (so a
    step without a match still accepts more than the bonus token). The two depths are fitted by simulating
    it on the tuning requests' replay: the engine's n-gram drafter on the true contexts, the model's ranks
    from teacher forcing, each step priced with the measured step cost of its drafter at its depth."""

    default_name = "hybrid-drafter"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        inc = ctx.recipe
        if ("model" not in tools.drafters or inc.tree.policy != "chain"
                or inc.draft.method not in ("model", "ngram")):
            return AgentFailure(self.name, f"two-level drafting needs a drafter model and a chain; the incumbent "
                                           f"drafts {inc.draft.method} with {tree_label(inc)}")
        deepest = max(12, inc.tree.depth)
        model_replay = tools.replay("model")
        ngram_replay = tools.replay("ngram", inc.draft.ngram_max)
        model_runs = {t.request_id: _rank0_runs(t.ranks, t.prompt_len, t.n_out, len(t.tokens) - 1)[0]
                      for t in model_replay.traces}
        walks = []
        for t in ngram_replay.traces:
            run, walk = _ngram_runs(t.tokens, t.prompt_len, t.n_out, inc.draft.ngram_max, deepest)
            matched = _ngram_matches(t.tokens, t.prompt_len, inc.draft.ngram_max)
            walks.append((run, matched, model_runs.get(t.request_id, {}), walk))
        price = {(m, c): sum(tools.step_ms(inc.replace(draft={"method": m}, tree={"depth": c})).values())
                 for m in ("model", "ngram") for c in range(1, deepest + 1)}

        def rate(ngram_depth: int, model_depth: int, mode: str) -> float:
            tokens = ms = 0.0
            for run, matched, mrun, (start, n_out, last) in walks:
                i, emitted = start, 0
                while emitted < n_out and i < last:
                    lookup = mode == "ngram" or (mode == "hybrid" and matched.get(i, False))
                    if lookup:
                        d, ms = min(run.get(i, 0), ngram_depth, last - i - 1), ms + price[("ngram", ngram_depth)]
                    else:
                        d, ms = min(mrun.get(i, 0), model_depth, last - i - 1), ms + price[("model", model_depth)]
                    emitted += d + 1
                    i += d + 1
                tokens += n_out
            return tokens / ms if ms else 0.0

        depth = inc.tree.depth
        base = rate(depth, depth, inc.draft.method)
        say(f"incumbent {inc.draft.method} chain {depth}: {1e3 * base:.0f} tok/s simulated")
        best = max((rate(c, m, "hybrid"), -c, -m) for c in range(1, deepest + 1)
                   for m in range(1, min(c, MAX_DEPTH) + 1))  # the model drafts at most the tree's depth
        r, c, m = best[0], -best[1], -best[2]
        say(f"fitted: n-gram lookup to depth {c} where the context matches, the model to depth {m} elsewhere: "
            f"{1e3 * r:.0f} tok/s simulated ({pct(r, base)})")
        if r < base * (1 + MIN_GAIN):
            return AgentFailure(self.name, f"no two-level drafter predicted above the incumbent (best: n-gram depth "
                                           f"{c}, model depth {m}, {pct(r, base)})")
        name = f"hybrid_m{m}"
        source = HYBRID_TEMPLATE.replace("{model_depth}", str(m)).replace("{name}", name)
        new = inc.replace(draft={"method": f"plugin:{name}"}, tree={"depth": c}).validate()
        rationale = (f"Simulated on the replay with each drafter's measured step cost: n-gram lookup to depth {c} "
                     f"where the context has a match and the drafter model to depth {m} elsewhere gives "
                     f"{pct(r, base)} over the incumbent {inc.draft.method} chain {depth}.")
        return self.plugin_candidate(inc, new, name, source, f"Two-level drafter plugin (n-gram depth {c}, model "
                                     f"depth {m})", rationale, r / base, say)


def _ngram_matches(tokens: list[int], prompt_len: int, ngram_max: int) -> dict[int, bool]:
    """For each position a step can start from, whether the engine's n-gram drafter finds a match there."""
    from core.engine.drafters import DraftMode, NgramDrafter, TreeSpec

    drafter = NgramDrafter(ngram_max)
    drafter.reset([tokens[:prompt_len]], len(tokens) + 8)
    spec, mode, out = TreeSpec("static", [[0]]), DraftMode(), {}
    for i in range(prompt_len - 1, len(tokens) - 1):
        out[i] = len(drafter.draft(spec, mode, [True])[0]) > 1
        drafter.commit([0], [[]], [[tokens[i + 1]]])
    return out


def _ngram_runs(tokens: list[int], prompt_len: int, n_out: int, ngram_max: int,
                depth: int) -> tuple[dict[int, int], tuple[int, int, int]]:
    """For each position i a step can start from, how many tokens of the n-gram drafter's chain (drafted on
    the true context up to i, as the engine's NgramDrafter does) equal the target's next ones. A chain's
    continuation at a shorter depth is a prefix of the deeper one, so min(run, depth) is what it accepts."""
    from core.engine.drafters import DraftMode, NgramDrafter, TreeSpec
    from core.engine.tree import chain_paths

    last = len(tokens) - 1
    drafter = NgramDrafter(ngram_max)
    drafter.reset([tokens[:prompt_len]], len(tokens) + depth + 4)
    spec, mode = TreeSpec("static", chain_paths(depth)), DraftMode()
    run: dict[int, int] = {}
    for i in range(prompt_len - 1, last):
        drafted = drafter.draft(spec, mode, [True])[0].tokens[1:]
        k = 0
        while k < len(drafted) and i + k + 1 <= last and drafted[k] == tokens[i + k + 1]:
            k += 1
        run[i] = k
        drafter.commit([0], [[]], [[tokens[i + 1]]])
    return run, (prompt_len - 1, n_out, last)


def _rank0_runs(ranks: list[int], prompt_len: int, n_out: int,
                last: int) -> tuple[dict[int, int], tuple[int, int, int]]:
    """For each position i a step can start from, how many of the next tokens the drafter ranks first (what
    a chain of unlimited depth would accept), and the walk's (start, n_out, last)."""
    run: dict[int, int] = {}
    count = 0
    for i in range(last - 1, prompt_len - 2, -1):
        count = count + 1 if i + 1 < len(ranks) and ranks[i + 1] == 0 else 0
        run[i] = count
    return run, (prompt_len - 1, n_out, last)


def _nodes(recipe: Recipe) -> int:
    """Draft nodes per row (the root, which is verified too, not counted)."""
    t = recipe.tree
    if t.policy == "chain":
        return t.depth
    if t.policy == "static":
        return len(static_prefixes(t.paths))
    return t.budget


def cut_tree(recipe: Recipe, nodes: int) -> Recipe:
    """The recipe's tree cut to its first `nodes` nodes (what a per-row token cap leaves)."""
    t = recipe.tree
    if t.policy == "chain":
        return recipe.replace(tree={"depth": min(t.depth, nodes)})
    if t.policy == "dynamic":
        return recipe.replace(tree={"budget": min(t.budget, nodes)})
    kept = static_prefixes(t.paths)[:nodes]
    inner = {p[:-1] for p in kept}
    return static_tree(recipe, [list(p) for p in kept if p not in inner], t.budget)


class MemoryAgent(LocalAgent):
    """Starts from what won before: the best remembered fragment(s) not already in the incumbent."""

    default_name = "memory"
    needs_tools = False

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        here = _fingerprint(ctx.deployment)
        found = [(e, r) for e, r in applicable(ctx.memory, ctx.recipe)
                 if r is None or not rejection_of(r, ctx.recipe, ctx.rejected)]
        if not found:
            return AgentFailure(self.name, f"no remembered mechanism applies: {len(ctx.memory)} entries, all already "
                                           "in the incumbent or invalid for it")
        found.sort(key=lambda item: (item[0].get("fingerprint") != here, -(effect_of(item[0]) or 0.0)))
        base_pred = tools.predict(ctx.recipe) if tools is not None else None
        new, used, sections = ctx.recipe, [], set()
        for entry, _ in found:
            fragment = entry["fragment"]
            if sections & set(fragment):
                continue
            try:
                trial = apply_fragment(new, fragment)
            except (RecipeError, TypeError, KeyError, ValueError):
                continue
            effect = effect_of(entry)
            where = entry.get("fingerprint", "unknown")
            say(f"from memory: {entry.get('mechanism', 'unnamed')} (won {effect or 0:.2f}x on {where})"
                + ("" if where == here else f"; recorded on another deployment, this one is {here}"))
            if tools is not None:
                pred = tools.predict(trial)
                say(f"  predicted here: {pred:.0f} tok/s ({pct(pred, base_pred)})")
                if used and pred < tools.predict(new):
                    say("  not stacked: predicted below the fragments already taken")
                    continue
            new, sections = trial, sections | set(fragment)
            used.append(entry)
        speedup = tools.predict(new) / base_pred if tools is not None and base_pred else (
            effect_of(used[0]) if used[0].get("fingerprint") == here else None)
        names = " + ".join(str(e.get("mechanism", "unnamed")) for e in used)
        rationale = "; ".join(f"{e.get('mechanism')}: {e.get('description', '')} (won {effect_of(e) or 0:.2f}x on "
                              f"{e.get('fingerprint', 'unknown')})" for e in used)
        files = remembered_plugins(used, ctx.workspace)
        diff = "".join(make_unified_diff("", text, path) for path, text in files.items())
        say.part(diff)
        out = self.candidate(ctx, new, f"From memory: {names}", rationale, speedup, say)
        if files:
            out.kind, out.files, out.diff = "recipe+plugin", files, diff + out.diff
        return out


def _fingerprint(deployment: dict[str, Any]) -> str | None:
    if deployment.get("fingerprint"):
        return str(deployment["fingerprint"])
    try:
        return Deployment(**{k: v for k, v in deployment.items() if k in Deployment.__dataclass_fields__}).fingerprint()
    except (TypeError, OSError):
        return None


RuntimeAgent.cpu_only = True
BatchingAgent.needs_batch = True

GAP_AGENTS: dict[str, tuple[type[LocalAgent], ...]] = {
    "acceptance": (TreeShapeAgent, DraftLengthAgent, HybridDrafterAgent),
    "drafting": (DrafterFormatAgent, DrafterChoiceAgent, DraftLengthAgent, AdaptiveLengthAgent, HybridDrafterAgent),
    "weights": (WeightFormatAgent,),
    "verify": (RuntimeAgent, WeightFormatAgent, DraftLengthAgent, TreeShapeAgent),
    "host": (AdaptiveLengthAgent, DraftLengthAgent, RuntimeAgent),
    "prompt": (),  # the prefill: no recipe field changes it (see registry.HINTS)
    "dispatch": (RuntimeAgent, DraftLengthAgent, TreeShapeAgent),
    "batching": (BatchingAgent,),
}
DEFAULT_ORDER: tuple[type[LocalAgent], ...] = (TreeShapeAgent, DrafterChoiceAgent, DraftLengthAgent,
                                                 WeightFormatAgent, RuntimeAgent, BatchingAgent, AdaptiveLengthAgent,
                                                 HybridDrafterAgent, DrafterFormatAgent)
KNOB_AGENTS = ("tree-shape", "drafter-choice", "draft-length", "weight-format", "runtime", "batching", "memory",
               "drafter-format")
