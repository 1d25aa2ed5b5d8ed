"""What every local agent shares: the base class that turns a search into a candidate (or a reason), the
option it weighs, the stream it reports through, and the recipe-shape helpers several agents use."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local import templates
from specpilot.core.costmodel.tools import numerics_refusal
from specpilot.core.diffs import RECIPE_FILE, make_unified_diff
from specpilot.core.engine.numerics import NumericsError
from specpilot.core.engine.tree import static_prefixes
from specpilot.core.memory import rejection_line, rejection_of
from specpilot.core.recipe import Recipe

MIN_GAIN = 0.01  # below this the judge's noise floor swallows the change: not worth a timing slot
MAX_DEPTH = 8
CHAIN_DEPTHS = tuple(range(1, 11))
NGRAM_DEPTHS = tuple(range(1, 13))
KNEE = 1.25  # a node budget stays on the flat (memory-bound) part while verify costs <= 1.25x one token per row


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
    """A change as a signed percentage, so every agent's stream reads the same way."""
    return f"{value / base - 1:+.1%}" if base > 0 else "n/a"


def evaluate(tools: Any, label: str, recipe: Recipe) -> Option:
    """Validate `recipe` and ask the cost model for its replayed acceptance and predicted speed."""
    recipe.validate()
    return Option(label, recipe, tools.accepted(recipe), tools.predict(recipe))


def incumbent(tools: Any, recipe: Recipe, say: Callable[[str], None]) -> Option:
    """The incumbent's option, streamed first so what an agent prices next reads against it."""
    base = evaluate(tools, "incumbent", recipe)
    say(f"incumbent {tree_label(recipe)}: {base.accepted:.2f} tokens/step, predicted {base.predicted:.0f} tok/s")
    return base


def best_of(options: list[Option], seed: int) -> Option:
    """The fastest predicted option; exact ties go to a seeded draw so a seed fully determines the choice."""
    rng = random.Random(seed)
    keyed = [(o.predicted, rng.random(), o) for o in options]
    return max(keyed, key=lambda k: (k[0], k[1]))[2]


def tree_label(recipe: Recipe) -> str:
    """The recipe's tree in the words the agents stream and title candidates with."""
    t = recipe.tree
    if t.policy == "chain":
        return f"chain {t.depth}"
    if t.policy == "static":
        return f"static tree ({len(static_prefixes(t.paths))} nodes, depth {max(len(p) for p in t.paths)})"
    if t.policy == "dynamic":
        return f"dynamic tree (budget {t.budget}, depth {t.depth}, topk {t.topk})"
    return t.policy


def static_tree(recipe: Recipe, paths: list[list[int]], budget: int) -> Recipe:
    """`recipe` with a static tree of `paths` (its depth set from them, as validation requires)."""
    return recipe.replace(tree={"policy": "static", "paths": [list(p) for p in paths], "budget": budget,
                                "depth": max(len(p) for p in paths)})


def draft_nodes(recipe: Recipe) -> int:
    """Draft nodes per row (the root, which is verified too, not counted)."""
    t = recipe.tree
    if t.policy == "chain":
        return t.depth
    if t.policy == "static":
        return len(static_prefixes(t.paths))
    return t.budget


def flat_width(tools: Any, widest: int = 64) -> int:
    """The most tokens one verify step takes for at most KNEE x one token's measured cost (1 where even two
    tokens cost more): how far the verify curve is flat. A GPU or matrix unit is flat past 33 tokens; the q8
    numerics on a CPU (integer products, memory-bound) to about 4-5 rows; float32 products on a CPU not at all."""
    one = max(tools.verify_ms(1), 1e-9)
    return max(n for n in range(1, widest + 1) if tools.verify_ms(n) <= KNEE * one)


def numerics_of(ctx: AgentContext, tools: Any) -> str:
    """The deployment's numerics: the cost tools' (the engine's), else the context's deployment's, else f32."""
    return getattr(tools, "numerics", None) or (ctx.deployment or {}).get("numerics") or "f32"


def refusal(ctx: AgentContext, tools: Any, recipe: Recipe) -> str | None:
    """Why the deployment's numerics refuse `recipe` (its target weight format or linear backend would change
    the target's products), or None: agents filter by it rather than propose what the judge must refuse."""
    return numerics_refusal(numerics_of(ctx, tools), recipe)


def report_numerics(report: dict[str, Any] | None) -> str:
    """The numerics a cost report's profile was measured under ('f32' when it does not say)."""
    return str(((report or {}).get("profile") or {}).get("numerics") or "f32")


def report_device(report: dict[str, Any] | None) -> str:
    """The device a cost report was measured on ('cpu' when it does not say)."""
    return str(((report or {}).get("probe") or {}).get("device", "cpu"))


class LocalAgent:
    """Shared plumbing: checks for tools, turns agent-side errors into failures, builds the candidate."""

    default_name = "local"
    needs_tools = True

    def __init__(self, name: str | None = None, seed: int = 0) -> None:
        self.name = name or self.default_name
        self.seed = seed

    @classmethod
    def applies(cls, report: dict[str, Any] | None) -> str | None:
        """Why this agent's mechanism cannot apply where `report` was measured, or None when it may: the
        registry runs the ones that may first, and a second pass in a round runs only those."""
        return None

    def propose(self, ctx: AgentContext, on_chunk: Callable[[str], None]) -> Candidate | AgentFailure:
        """Search with the round's cost tools; an agent-side error is a failed candidate, never the loop's crash."""
        if self.needs_tools and ctx.tools is None:
            return AgentFailure(self.name, "no cost model in the context (ctx.tools is None); local agents predict "
                                           "every change with CostTools before proposing it")
        try:
            return self.search(ctx, ctx.tools, Stream(on_chunk))
        except Exception as exc:  # an agent-side problem is a failed candidate, never the loop's crash
            return AgentFailure(self.name, f"{type(exc).__name__}: {exc}")

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """The agent's own search; each agent module implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement search()")

    def tie_seed(self, ctx: AgentContext) -> int:
        """The seed for exact ties: the round's and the agent's, so two agents of one round draw apart."""
        return ctx.seed * 1_000_003 + self.seed

    def finish(self, ctx: AgentContext, base: Option, options: list[Option], what: str, say: Stream,
               rationale: str) -> Candidate | AgentFailure:
        """Propose the best option if it clears MIN_GAIN over the incumbent, else fail saying how close it got."""
        inc_toml = ctx.recipe.to_toml()
        options = [o for o in options if o.recipe.to_toml() != inc_toml]
        for o in [o for o in options if refusal(ctx, ctx.tools, o.recipe)]:
            say(f"not proposing {o.label}: {refusal(ctx, ctx.tools, o.recipe)}")
            options.remove(o)
        for o in [o for o in options if rejection_of(o.recipe, ctx.recipe, ctx.rejected)]:
            say(f"not proposing {o.label}: it repeats {rejection_line(rejection_of(o.recipe, ctx.recipe, ctx.rejected))}")
            options.remove(o)
        if not options:
            return AgentFailure(self.name, f"no {what} differs from the incumbent")
        best = best_of(options, self.tie_seed(ctx))
        if failure := self.short_of(what, best.label, best.predicted, base.predicted):
            return failure
        speedup = best.predicted / base.predicted
        say(f"proposing {best.label}: {best.accepted:.2f} tokens/step, predicted {best.predicted:.0f} tok/s vs "
            f"{base.predicted:.0f} ({speedup:.3f}x)")
        return self.candidate(ctx, best.recipe, best.label, rationale.format(best=best, base=base, speedup=speedup),
                              speedup, say)

    def short_of(self, what: str, best: str, predicted: float, base: float) -> AgentFailure | None:
        """The failure to report when the best found is predicted less than MIN_GAIN above the incumbent."""
        if predicted < base * (1 + MIN_GAIN):
            return AgentFailure(self.name, f"no {what} predicted above the incumbent (best: {best}, "
                                           f"{pct(predicted, base)})")
        return None

    def plugin_candidate(self, inc: Recipe, new: Recipe, template: str, values: dict[str, int | str], what: str,
                         fitted: str, rate: float, base: float, rationale: str,
                         say: Stream) -> Candidate | AgentFailure:
        """What a code-writing agent proposes for the plugin it fitted (`what`, with its parameters `fitted` in
        words) at simulated `rate` against the incumbent's `base`: workspace plugin `plugins/<name>.py`,
        `template` filled with `values` (the plugin's `name` among them), and the recipe `new` selecting it;
        or the failure when that clears MIN_GAIN over the incumbent by too little."""
        if failure := self.short_of(what, fitted, rate, base):
            return failure
        new.validate()
        path = f"plugins/{values['name']}.py"
        source = templates.render(template, **values)
        diff = make_unified_diff("", source, path) + make_unified_diff(inc.to_toml(), new.to_toml(), RECIPE_FILE)
        say.part(diff)
        title = f"{what[0].upper()}{what[1:]} plugin ({fitted})"
        return Candidate(agent=self.name, title=title, rationale=rationale, kind="recipe+plugin", diff=diff,
                         recipe=new, files={path: source}, predicted_speedup=rate / base)

    def candidate(self, ctx: AgentContext, new: Recipe, title: str, rationale: str, speedup: float | None,
                  say: Stream) -> Candidate:
        """A recipe-only candidate: the validated recipe and its diff against the incumbent, streamed. A recipe
        the deployment's numerics refuse is never proposed (agents filter first; this is the last guard)."""
        new.validate()
        if why := refusal(ctx, ctx.tools, new):
            raise NumericsError(why)
        diff = make_unified_diff(ctx.recipe.to_toml(), new.to_toml(), RECIPE_FILE)
        say.part(diff)
        return Candidate(agent=self.name, title=title[:120], rationale=rationale, kind="recipe", diff=diff,
                         recipe=new, predicted_speedup=speedup)
