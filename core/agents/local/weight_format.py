"""The weight-format agent: the weights and verify gaps, by how many bytes each target weight reads."""

from __future__ import annotations

from typing import Any

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local.common import (MIN_GAIN, LocalAgent, Stream, evaluate, numerics_of, pct, refusal,
                                                report_device, report_numerics)
from specpilot.core.engine.numerics import NumericsError, check_recipe as check_numerics
from specpilot.core.mechanisms import curve, own_curves

PACKED_BYTES = 12 / 16


class WeightFormatAgent(LocalAgent):
    """Weights and verify gaps: read the checkpoint's own GGUF blocks (exact, a quarter of float32's bytes on
    a Q4_K model), priced on the profile's measured gguf forward curves; else packed12, which reads 12/16 of
    the bytes and pays only where verify is memory-bound and the fused kernel exists (CUDA)."""

    default_name = "weight-format"

    @classmethod
    def applies(cls, report: dict[str, Any] | None) -> str | None:
        """packed12 pays only with the fused CUDA kernel; gguf wherever the profile measured the checkpoint's
        own blocks (a GGUF checkpoint, on any device)."""
        device = report_device(report)
        curves = ((report or {}).get("profile") or {}).get("backend_curves") or {}
        if any(key in curves for key in own_curves("weight_format")):
            return None
        if device.startswith("cuda"):
            try:
                check_numerics(report_numerics(report), "packed12", "native")
            except NumericsError:
                return (f"numerics {report_numerics(report)} fixes the target's products: no packed12, and no gguf "
                        "measured")
            return None
        return (f"packed12 pays only with the fused CUDA kernel (this is {device}) and the profile measured no "
                "gguf blocks")

    def search(self, ctx: AgentContext, tools: Any, say: Stream) -> Candidate | AgentFailure:
        """A format with its own kernel (gguf) where the profile measured it, else packed12 where verify is
        weight-bandwidth-bound on CUDA."""
        inc = ctx.recipe
        curves = tools.profile.backend_curves
        if curve("weight_format", inc.weights.format):
            return AgentFailure(self.name, f"the weights are already read as stored ({inc.weights.format}): no "
                                           "exact format reads fewer bytes")
        measured = {key: name for key, name in own_curves("weight_format").items() if key in curves}
        if measured:
            return self.own_kernel(ctx, tools, say, curves, measured)
        if inc.weights.format == "packed12":
            return AgentFailure(self.name, "weights are already packed12; no other lossless format to try")
        if why := refusal(ctx, tools, inc.switched("weight_format", "packed12")):
            return AgentFailure(self.name, f"packed12 is not an option under numerics {numerics_of(ctx, tools)}: {why}")
        base_pred = tools.predict(inc)
        step = tools.step_ms(inc)
        total = sum(step.values())
        verify = step["verify"]
        bound = min(tools.weight_ms, verify)
        say(f"step {total:.2f} ms: verify {verify:.2f} ms, of which reading the target's weights at the measured "
            f"bandwidth is {bound:.2f} ms ({bound / verify:.0%})" if verify > 0 else f"step {total:.2f} ms")
        if not str(tools.device).startswith("cuda"):
            say(f"on {tools.device} packed12 decodes to bf16 and runs the dense matmul: verify still reads 16/16 "
                "of the weight bytes, plus a wrapper call per linear")
            return AgentFailure(self.name, f"packed12 on {tools.device} is a correctness path (decode then matmul): "
                                           "verify still reads 16/16 of the weight bytes plus extra dispatch per "
                                           "linear, so it predicts a slowdown (x1.00 at best); it pays only with the "
                                           "fused CUDA kernel")
        saved = bound * (1 - PACKED_BYTES)
        speedup = total / (total - saved) if total > saved else 1.0
        predicted = base_pred * speedup
        say(f"packed12 reads 12/16 of those bytes: verify {verify:.2f} -> {verify - saved:.2f} ms/step, predicted "
            f"{predicted:.0f} tok/s ({pct(predicted, base_pred)}; {1 / PACKED_BYTES:.2f}x at most on the "
            "memory-bound part)")
        if speedup < 1 + MIN_GAIN:
            return AgentFailure(self.name, f"packed12 predicted {pct(predicted, base_pred)}: the verify step is not "
                                           "weight-bandwidth-bound enough to pay")
        new = inc.switched("weight_format", "packed12")
        rationale = (f"Verification reads every target weight once per step; {bound:.2f} of {verify:.2f} ms is that "
                     f"read at the measured bandwidth. Packed12 is lossless (bit-exact decode) and reads 12/16 of "
                     f"the bytes in the fused kernel: predicted {speedup:.3f}x.")
        return self.candidate(ctx, new, "packed12 target weights (12/16 of the verify bytes)", rationale, speedup, say)

    def own_kernel(self, ctx: AgentContext, tools: Any, say: Stream, curves: dict,
                   measured: dict[str, str]) -> Candidate | AgentFailure:
        """Propose the weight format with its own kernel (`measured`: curve key -> name) that the measured
        curves predict fastest, switched as its registration says (gguf: target and drafter)."""
        inc = ctx.recipe
        mine = tools.profile.verify_curve_for(inc.runtime.linear)
        base = evaluate(tools, f"{inc.weights.format} weights", inc)
        options = []
        for key, name in measured.items():
            if why := refusal(ctx, tools, inc.switched("weight_format", name)):
                say(f"not pricing {name}: {why}")
                continue
            points = ", ".join(f"{n} nodes {curves[key][n]:.0f} vs {mine[n]:.0f} ms"
                               for n in (1, 4, 8, 16) if n in curves[key] and n in mine)
            say(f"target forward, {name} blocks vs {inc.weights.format} weights on {inc.runtime.linear}: {points}")
            switched = inc.switched("weight_format", name)
            both = " (target and drafter)" if switched.weights.drafter else ""
            option = evaluate(tools, f"{name} weights{both}", switched)
            say(f"{name}: predicted {option.predicted:.0f} tok/s ({pct(option.predicted, base.predicted)})")
            options.append(option)
        rationale = ("The checkpoint's weights as stored ({best.label}), dequantised exactly in the format's own "
                     "kernel, read far fewer bytes than float32 weights, and a verify step reuses each block for every "
                     "node (measured forward curve); the values are the reference's bit for bit, so only near-ties "
                     "can move: predicted x{speedup:.3f}.")
        return self.finish(ctx, base, options, "weight format", say, rationale)
