"""The drafter-choice agent: the drafting gap, by which drafter proposes the tokens."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import (CHAIN_DEPTHS, NGRAM_DEPTHS, LocalAgent, Stream, best_of, evaluate, pct,
                                      tree_label)
from specpilot.core.agents.local.keys import DrafterKey
from specpilot.core.recipe import RecipeError


class DrafterChoiceAgent(LocalAgent):
    """Drafting gap: model vs n-gram vs early exit at each exit layer, each with its best chain and the
    incumbent's shape."""

    default_name = "drafter-choice"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Price every other drafter the cost model replays, each at its best chain or the incumbent's shape."""
        inc = ctx.recipe
        current = DrafterKey.of(inc, tools.layers)
        base = evaluate(tools, "incumbent", inc)
        say(f"drafters available: {', '.join(tools.drafters)}; incumbent {current} with {tree_label(inc)}: "
            f"{base.accepted:.2f} tokens/step, predicted {base.predicted:.0f} tok/s")
        options = []
        for key in map(DrafterKey.parse, tools.drafters):
            if key == current:
                continue
            try:
                shaped = key.drafting(inc).validate()
            except RecipeError as exc:
                say(f"{key}: skipped ({exc})")
                continue
            depths = NGRAM_DEPTHS if key.method == "ngram" else CHAIN_DEPTHS
            shapes = [(tree_label(shaped), shaped)]
            shapes += [(f"chain {d}", shaped.replace(tree={"policy": "chain", "depth": d, "paths": []}))
                       for d in depths]
            tried = [(shape, evaluate(tools, f"{key} drafter, {shape}", recipe)) for shape, recipe in shapes]
            best = best_of([option for _, option in tried], self.tie_seed(ctx))
            shape = next(shape for shape, option in tried if option is best)
            say(f"{key}: best {shape}: {best.accepted:.2f} tokens/step, predicted "
                f"{best.predicted:.0f} tok/s ({pct(best.predicted, base.predicted)})")
            options.append(best)
        return self.finish(ctx, base, options, "other drafter", say,
                           "Replaying each drafter on the recorded outputs: {best.label} accepts {best.accepted:.2f} "
                           "tokens/step; with its measured draft cost the cost model predicts {speedup:.3f}x.")
