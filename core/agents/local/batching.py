"""The batching agent: the batching gap, by how rows share one verify step's tokens."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import (KNEE, MAX_DEPTH, LocalAgent, Option, Stream, draft_nodes, evaluate, pct,
                                      static_tree)
from specpilot.core.engine.tree import static_prefixes
from specpilot.core.recipe import Recipe

CURVE_POINTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


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


class BatchingAgent(LocalAgent):
    """Batching gap: at batch > 1 every row drafting a full tree overflows the flat part of the verify curve;
    a shared node budget at the curve's knee keeps verification memory-bound."""

    default_name = "batching"

    @classmethod
    def applies(cls, report: dict[str, Any] | None) -> str | None:
        """Rows share a step only at batch > 1."""
        batch = int((report or {}).get("batch_size", 1))
        return f"batch size {batch}: no batching gap" if batch <= 1 else None

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Find the verify curve's knee and price a shared node budget and a per-row cap at it."""
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
        tokens = batch * (draft_nodes(inc) + 1)
        where = "past" if tokens > knee else "below"
        return self.finish(ctx, base, options, "batching policy", say,
                           f"At batch {batch} per-row trees of {draft_nodes(inc)} nodes verify {tokens} tokens per "
                           f"step, {where} the knee of the verify cost curve ({knee} tokens); "
                           "{best.label} spends exactly the flat part of the curve: predicted {speedup:.3f}x.")

    @staticmethod
    def throughput(tools: Any, shape: Recipe, batch: int, accepted: float, say: Stream, label: str) -> float:
        """Tokens per ms for `batch` rows each drafting `shape`: the batch shares one draft and verify step."""
        step = tools.step_ms(shape)
        tokens = batch * (draft_nodes(shape) + 1)
        ms = step["draft"] + step.get("host", 0.0) + step.get("commit", 0.0) + tools.verify_ms(tokens)
        say(f"{label}: {batch} x {draft_nodes(shape)} nodes ({tokens} tokens verified), {accepted:.2f} "
            f"tokens/row/step, {ms:.2f} ms/step")
        return batch * accepted / ms
