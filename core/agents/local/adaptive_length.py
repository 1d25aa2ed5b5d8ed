"""The adaptive-length agent: the drafting and host gaps, by writing a draft-length plugin
(templates/adaptive.py) fitted on the replayed acceptance."""

from __future__ import annotations

from typing import Any, Callable

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import MAX_DEPTH, LocalAgent, Stream, pct, tree_label
from specpilot.core.agents.local.keys import DrafterKey
from specpilot.core.agents.local.replays import ngram_runs, rank0_runs

ADAPTIVE_WINDOWS = (1, 2, 3, 4)
ADAPTIVE_MARGINS = (0, 1, 2)


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
        """Fit window, margin and depth cap by simulation, and write the plugin if it beats the incumbent."""
        inc = ctx.recipe
        if inc.tree.policy != "chain":
            return AgentFailure(self.name, f"the adaptive draft length is fitted on a chain; the incumbent drafts "
                                           f"{tree_label(inc)}")
        if inc.draft.length != "fixed":
            return AgentFailure(self.name, f"draft.length is already {inc.draft.length!r}")
        deepest = max(MAX_DEPTH, inc.tree.depth)
        replay = tools.replay(str(DrafterKey.of(inc, tools.layers)), inc.draft.ngram_max)
        if inc.draft.method == "ngram":
            runs = [ngram_runs(t.tokens, t.prompt_len, t.n_out, inc.draft.ngram_max, deepest) for t in replay.traces]
        else:
            runs = [rank0_runs(t.ranks, t.prompt_len, t.n_out, len(t.tokens) - 1) for t in replay.traces]
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
        name = f"adaptive_w{w}_m{m}"
        rationale = (f"Simulated on the replayed acceptance with the measured step cost per depth, drafting the mean "
                     f"of the last {w} step(s)' accepted tokens + {m} (at most {top}) gives {pct(r, base)} over "
                     f"chain {inc.tree.depth} and {pct(r, fixed_rate)} over the best fixed depth {best_fixed}.")
        return self.plugin_candidate(inc, inc.replace(draft={"length": f"plugin:{name}"}, tree={"depth": top}),
                                     "adaptive", {"window": w, "margin": m, "name": name}, "adaptive draft length",
                                     f"window {w}, margin {m}, depth {top}", r, base, rationale, say)
