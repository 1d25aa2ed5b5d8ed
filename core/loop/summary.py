"""What a round produces, as values: its gaps, its judged candidates and the incumbent it ends with, with
where that incumbent stands. The run's JSON summary (printed by `specpilot run --json`, stored with the
run) is built from them, so its shape is written once, here."""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.core.loop.control import Pending
from specpilot.core.recipe import Recipe
from specpilot.core.stats import Comparison


@dataclass(frozen=True)
class Standing:
    """The incumbent's held-out speedups over AR and over stock, and the interval of the one it was last
    judged by: what each round reports, and what a resumed run starts from."""

    vs_ar: float
    vs_stock: float
    interval: list[float] | None

    @classmethod
    def of_stock(cls, vs_ar: Comparison) -> Standing:
        """Stock as the incumbent: 1.0 against itself, so the interval is that of its speedup over AR."""
        return cls(vs_ar.speedup, 1.0, [vs_ar.low, vs_ar.high])

    @classmethod
    def measured(cls, vs_ar: Comparison, vs_stock: Comparison) -> Standing:
        """A new incumbent, timed against AR and stock; the interval is that of its speedup over stock."""
        return cls(vs_ar.speedup, vs_stock.speedup, [vs_stock.low, vs_stock.high])

    @classmethod
    def from_payload(cls, incumbent: dict) -> Standing:
        """A stored round's incumbent (the `incumbent` event's payload), for a resumed run."""
        return cls(incumbent["heldout_speedup_vs_ar"], incumbent["heldout_speedup_vs_stock"],
                   incumbent.get("interval"))

    def to_dict(self) -> dict:
        """The standing under the names the `incumbent` event and the summary use."""
        return {"heldout_speedup_vs_ar": self.vs_ar, "heldout_speedup_vs_stock": self.vs_stock,
                "interval": self.interval}


@dataclass(frozen=True)
class Judged:
    """One candidate of a round once it is decided: which gates it passed, why it failed if it did, what
    the person (or --auto) decided, and its held-out result."""

    cid: str
    agent: str
    title: str
    gates: dict[str, bool]
    passed: bool
    reason: str
    decision: str | None
    predicted_speedup: float | None
    heldout: Comparison | None
    forcing_rate: float | None

    @classmethod
    def from_pending(cls, p: Pending) -> Judged:
        """The value of a judged candidate, taken when the round's decisions are in."""
        v = p.verdict
        return cls(p.cid, p.candidate.agent, p.candidate.title, {g: r.passed for g, r in v.gates.items()}, p.passed,
                   v.reason, p.decision, p.candidate.predicted_speedup, v.heldout,
                   v.forcing.rate if v.forcing else None)

    def to_dict(self) -> dict:
        """The candidate as the run's summary lists it."""
        held = self.heldout
        return {"cid": self.cid, "agent": self.agent, "title": self.title, "gates": dict(self.gates),
                "verdict": "win" if self.passed else "fail", "reason": self.reason, "decision": self.decision,
                "predicted_speedup": self.predicted_speedup,
                "heldout_speedup": held.speedup if held else None,
                "interval": [held.low, held.high] if held else None,
                "forcing_rate": self.forcing_rate}


@dataclass(frozen=True)
class Round:
    """What one finished round produced: the cost model's view of the incumbent it started from, the
    candidates judged, and the incumbent it ends with (the same one when nothing won)."""

    index: int
    largest_gap: str
    gaps: list[dict]
    measured_tokens_per_s: float
    predicted_tokens_per_s: float | None
    incumbent: Recipe
    standing: Standing
    candidates: list[Judged]
    idle: str | None  # why no agent proposed anything, when none did

    @classmethod
    def of(cls, index: int, report: dict, pending: list[Pending], incumbent: Recipe, standing: Standing,
           idle: str | None) -> Round:
        """The round from its cost report (the incumbent it started from) and its decided candidates."""
        return cls(index, report["largest_gap"], report["gaps"], report["measured_tokens_per_s"],
                   report.get("predicted_tokens_per_s"), incumbent, standing,
                   [Judged.from_pending(p) for p in pending], idle)

    def to_dict(self) -> dict:
        """The round as the run's summary holds it (the JSON `specpilot run --json` prints and the store keeps)."""
        return {"index": self.index, "largest_gap": self.largest_gap,
                "candidates": [c.to_dict() for c in self.candidates],
                "incumbent": {"recipe": self.incumbent.to_toml(), **self.standing.to_dict()},
                "gaps": self.gaps, "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "measured_tokens_per_s": self.measured_tokens_per_s, "idle": self.idle}
