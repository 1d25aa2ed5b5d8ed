"""The hybrid-drafter agent: the drafting and acceptance gaps, by writing a two-level drafter plugin
(templates/hybrid.py) fitted on the replay."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import MAX_DEPTH, LocalAgent, Stream, pct, tree_label
from specpilot.core.agents.local.replays import ngram_matches, ngram_runs, rank0_runs


class HybridDrafterAgent(LocalAgent):
    """Drafting and acceptance gaps, by writing code: a drafter plugin that drafts by n-gram lookup where the
    context has a match (nearly free, long when it hits) and with the drafter model where it has none (so a
    step without a match still accepts more than the bonus token). The two depths are fitted by simulating
    it on the tuning requests' replay: the engine's n-gram drafter on the true contexts, the model's ranks
    from teacher forcing, each step priced with the measured step cost of its drafter at its depth."""

    default_name = "hybrid-drafter"

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Fit both depths by simulation, and write the plugin if it beats the incumbent."""
        inc = ctx.recipe
        if ("model" not in tools.drafters or inc.tree.policy != "chain"
                or inc.draft.method not in ("model", "ngram")):
            return AgentFailure(self.name, f"two-level drafting needs a drafter model and a chain; the incumbent "
                                           f"drafts {inc.draft.method} with {tree_label(inc)}")
        deepest = max(12, inc.tree.depth)
        model_replay = tools.replay("model")
        ngram_replay = tools.replay("ngram", inc.draft.ngram_max)
        model_runs = {t.request_id: rank0_runs(t.ranks, t.prompt_len, t.n_out, len(t.tokens) - 1)[0]
                      for t in model_replay.traces}
        walks = []
        for t in ngram_replay.traces:
            run, walk = ngram_runs(t.tokens, t.prompt_len, t.n_out, inc.draft.ngram_max, deepest)
            matched = ngram_matches(t.tokens, t.prompt_len, inc.draft.ngram_max)
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
        name = f"hybrid_m{m}"
        rationale = (f"Simulated on the replay with each drafter's measured step cost: n-gram lookup to depth {c} "
                     f"where the context has a match and the drafter model to depth {m} elsewhere gives "
                     f"{pct(r, base)} over the incumbent {inc.draft.method} chain {depth}.")
        return self.plugin_candidate(inc, inc.replace(draft={"method": f"plugin:{name}"}, tree={"depth": c}), "hybrid",
                                     {"model_depth": m, "name": name}, "two-level drafter",
                                     f"n-gram depth {c}, model depth {m}", r, base, rationale, say)
