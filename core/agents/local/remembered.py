"""The memory agent: starts a round from the mechanisms that won before (core.memory's entries)."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import LocalAgent, Stream, pct, refusal
from specpilot.core.deployment import Deployment
from specpilot.core.diffs import make_unified_diff
from specpilot.core.memory import apply_fragment, applicable, effect_of, rejection_of, remembered_plugins
from specpilot.core.recipe import RecipeError


class MemoryAgent(LocalAgent):
    """Starts from what won before: the best remembered fragment(s) not already in the incumbent."""

    default_name = "memory"
    needs_tools = False

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Stack the applicable remembered fragments, this deployment's first, and their plugins' sources."""
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
            if why := refusal(ctx, tools, trial):
                say(f"from memory: {entry.get('mechanism', 'unnamed')} (won on {where}) not applied here: {why}")
                continue
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
        if not used:
            return AgentFailure(self.name, "no remembered mechanism applies under this deployment's numerics")
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
    """The deployment's fingerprint, so this deployment's memories come first."""
    if deployment.get("fingerprint"):
        return str(deployment["fingerprint"])
    try:
        return Deployment(**{k: v for k, v in deployment.items() if k in Deployment.__dataclass_fields__}).fingerprint()
    except (TypeError, OSError):
        return None
