"""The drafter-format agent: the drafting gap, by the drafter model's weight format."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import LocalAgent, Stream, evaluate, pct
from specpilot.core.agents.local.keys import CurveKey, drafter_curves
from specpilot.core.mechanisms import own_curves

MIN_CUT = 0.9  # an approximate format applies where its one-row forward costs under 90% of the drafter's own


class DrafterFormatAgent(LocalAgent):
    """Drafting gap: the drafter model's products in approximate 8- or 4-bit blocks (weights.drafter_format,
    kernels/cpu/q8_draft.c), priced on the profile's measured drafter curves in each format. A drafter only
    proposes, so the output cannot change; its acceptance can, which the prediction holds at the profiled
    rate and the judge measures on held-out requests."""

    default_name = "drafter-format"

    @classmethod
    def applies(cls, report: dict[str, Any] | None) -> str | None:
        """Wherever the profile measured a drafter model whose one-row forward an approximate format makes at
        least 10% cheaper (a tiny drafter, bound by per-op overhead, gains nothing from fewer bytes)."""
        curves = drafter_curves(((report or {}).get("profile") or {}).get("drafter_backend_curves") or {})
        for key, curve in curves.items():
            if key.drafter_format != "same":
                mine, base = _one_row(curve), _one_row(curves.get(CurveKey(key.variant), {}))
                if mine is not None and base and mine < MIN_CUT * base:
                    return None
        return (f"the profile measured no approximate drafter format whose one-row forward costs under "
                f"{MIN_CUT:.0%} of the drafter's own")

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Price the drafter in each other measured format at the profiled acceptance."""
        inc = ctx.recipe
        if inc.draft.method != "model":
            return AgentFailure(self.name, f"the incumbent drafts with {inc.draft.method!r}, not a drafter model: "
                                           "no drafter weights to format")
        curves = drafter_curves(tools.profile.drafter_backend_curves)
        key = CurveKey.of(inc)
        base = evaluate(tools, f"drafter format {inc.weights.drafter_format}", inc)
        mine = curves.get(key, {})
        options = []
        for suffix, form in own_curves("drafter_format").items():
            measured = curves.get(key.in_format(suffix))
            if form == inc.weights.drafter_format or not measured:
                continue
            points = ", ".join(f"{w} rows {measured[w]:.1f} vs {mine[w]:.1f} ms" for w in sorted(measured) if w in mine)
            say(f"drafter forward in {form} blocks vs {inc.weights.drafter_format}: {points}")
            option = evaluate(tools, f"drafter in {form} blocks", inc.switched("drafter_format", form))
            say(f"{form}: predicted {option.predicted:.0f} tok/s ({pct(option.predicted, base.predicted)}) at the "
                "profiled acceptance")
            options.append(option)
        if not options:
            return AgentFailure(self.name, f"the profile measured no other drafter format on {key.variant}")
        rationale = ("The drafter only proposes tokens the target verifies, so its products may be approximate "
                     "without changing the output: {best.label} cuts its measured forward, predicted x{speedup:.3f} "
                     "if acceptance holds (the judge measures it).")
        return self.finish(ctx, base, options, "drafter format", say, rationale)


def _one_row(curve: dict[Any, float]) -> float | None:
    """A curve's one-row cost; a report read back from JSON keys its rows by strings."""
    return curve.get(1, curve.get("1"))
