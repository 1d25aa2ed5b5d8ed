"""The tree-shape agent: the acceptance gap, by the shape of what is drafted each step."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import (KNEE, MAX_DEPTH, LocalAgent, Stream, evaluate, flat_width, incumbent,
                                                pct, static_tree)

BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)
DYNAMIC_SHAPES = ((16, 6), (32, 6), (64, 8))  # (budget, depth); EAGLE-2 style, topk 4
# where the verify curve is flat (KNEE) for w tokens, shapes up to 2w deep are priced too: about the flat part's
# depth nearly free, as deep again at a price the replayed acceptance must pay for. A matrix unit or GPU (w >= 33)
# gets them all; the q8 numerics on a CPU (w about 4) chains to 8 and 16-32-node dynamic trees 4-8 deep
FLAT_SHAPES = ((8, 4), (16, 8), (24, 8), (32, 8), (32, 10), (32, 12))
FLAT_CHAINS = tuple(range(2, 13))


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
        width = flat_width(tools)
        deepest = 2 * width if width > 1 else 0
        flat_shapes = tuple(s for s in FLAT_SHAPES if s[1] <= deepest)
        chains = tuple(d for d in FLAT_CHAINS if d <= deepest)
        say(f"verify curve: 33 tokens cost {wide / one:.2f}x one; {width} cost <= {KNEE:.2f}x one" + (
            f": flat, so wider and deeper trees and deeper chains are worth pricing (to depth {min(deepest, 12)})"
            if deepest else ""))
        for budget, depth in DYNAMIC_SHAPES + flat_shapes:
            recipe = inc.replace(tree={"policy": "dynamic", "budget": budget, "depth": depth, "topk": 4, "paths": []})
            o = evaluate(tools, f"dynamic tree (budget {budget}, depth {depth})", recipe)
            say(f"dynamic budget {budget} depth {depth}: {o.accepted:.2f} tokens/step, predicted "
                f"{o.predicted:.0f} tok/s ({pct(o.predicted, base.predicted)})")
            options.append(o)
        for depth in chains:
            o = evaluate(tools, f"chain depth {depth}", inc.replace(tree={"policy": "chain", "depth": depth,
                                                                          "paths": []}))
            say(f"chain depth {depth}: {o.accepted:.2f} tokens/step, predicted {o.predicted:.0f} tok/s "
                f"({pct(o.predicted, base.predicted)})")
            options.append(o)
        return self.finish(ctx, base, options, f"tree within budget {max(BUDGETS)}", say,
                           "On the same drafter guesses, this shape locks in {best.accepted:.2f} tokens per verify "
                           "step vs {base.accepted:.2f} for the incumbent; with the measured verify cost curve the "
                           "cost model predicts {speedup:.3f}x.")
