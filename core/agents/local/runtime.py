"""The runtime agent: the verify and dispatch gaps on a CPU, by the linear backend verification runs on."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import (LocalAgent, Stream, evaluate, numerics_of, pct, refusal, report_device,
                                                report_numerics)
from specpilot.core.engine.numerics import TARGET_BACKENDS
from specpilot.core.mechanisms import builtin_names, curve


class RuntimeAgent(LocalAgent):
    """Verify and dispatch gaps on a CPU: verification runs few-row GEMMs, where the default BLAS can be much
    slower than oneDNN's or SpecPilot's skinny kernel, and some 25 small ops per layer, which the fused layer
    runs in one C call; the profile measured the target's forward under every linear backend, so the choice
    is priced on this machine, not assumed."""

    default_name = "runtime"

    @classmethod
    def applies(cls, report: dict[str, Any] | None) -> str | None:
        """The backends it chooses between (onednn, skinny, fused) run on a CPU only."""
        device = report_device(report)
        if device.startswith("cuda"):
            return f"the linear backends it chooses between run on a CPU; this is {device}"
        numerics = report_numerics(report)
        fixed = TARGET_BACKENDS.get(numerics)
        if fixed is not None and len(fixed) == 1:
            return f"numerics {numerics} fixes the target's products: runtime.linear stays {fixed[0]!r}"
        return None

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """Price every other linear backend the profile measured on this machine."""
        inc = ctx.recipe
        if curve("weight_format", inc.weights.format):
            return AgentFailure(self.name, f"the weights are read as stored ({inc.weights.format}), which runs its "
                                           "own block kernel on no linear backend: the runtime has nothing to change")
        curves = tools.profile.backend_curves
        mine = tools.profile.verify_curve_for(inc.runtime.linear)
        others = [b for b in curves if b in builtin_names("linear_backend") and b != inc.runtime.linear]
        refused = [b for b in others if refusal(ctx, tools, inc.replace(runtime={"linear": b}))]
        if refused:
            say(f"not pricing {', '.join(refused)}: numerics {numerics_of(ctx, tools)} fixes the target's products "
                "(runtime.linear = 'native')")
            others = [b for b in others if b not in refused]
        fixed = TARGET_BACKENDS.get(numerics_of(ctx, tools))
        if not others and fixed is not None and len(fixed) == 1:
            return AgentFailure(self.name, f"numerics {numerics_of(ctx, tools)} fixes the target's products: no "
                                           f"linear backend but {fixed[0]!r} may run it")
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
