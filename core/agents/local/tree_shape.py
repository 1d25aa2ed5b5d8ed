"""The tree-shape agent: the acceptance gap, by the shape of what is drafted each step."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import KNEE, MAX_DEPTH, LocalAgent, Stream, evaluate, incumbent, pct, static_tree

BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)
DYNAMIC_SHAPES = ((16, 6), (32, 6), (64, 8))  # (budget, depth); EAGLE-2 style, topk 4
# where verifying 33 tokens costs <= KNEE x one (a matrix unit, a GPU): wider and deeper shapes, and deeper chains
FLAT_SHAPES = ((8, 4), (16, 8), (24, 8), (32, 8), (32, 10), (32, 12))
FLAT_CHAINS = (6, 8, 10, 12)


class TreeShapeAgent(LocalAgent):
    """Acceptance gap: the best static tree per node budget from replay, plus dynamic trees; fastest wins."""

    default_name = "tree-shape"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Price the best static tree per budget, dynamic trees, and (on a flat verify curve) deeper shapes."""
        inc = ctx.recipe
        base = incumbent(tools, inc, say)
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
