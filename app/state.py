"""The dashboard's state model: pure Python, fed one event at a time.

`DashboardState.apply(event)` is the single dispatcher for everything the UI shows. Live events from
the loop and events read back from the store (replay) go through it alike; widgets only read the
state. `apply` returns the names of the panels that changed (see PANELS) so the UI refreshes only those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Callable

from specpilot.core import events as ev
from specpilot.core.costmodel.drift import describe as describe_drift
from specpilot.core.events import GATES, Event

PANELS = ("header", "gaps", "candidates", "stream", "forcing", "speedup", "status")


@dataclass
class GapView:
    """The latest cost-model gap breakdown."""

    round: int | None
    measured_tokens_per_s: float
    ceiling_tokens_per_s: float
    gaps: list[tuple[str, float]]
    largest: str
    drift: str = ""  # a q8 deployment's drift from transformers float32, one line (core/costmodel/drift.py)


@dataclass
class CandidateView:
    """One candidate as the dashboard knows it, from its first streamed chunk to the decision."""

    cid: str
    agent: str = ""
    direction: str = ""
    title: str = ""
    rationale: str = ""
    kind: str = ""
    diff: str = ""
    recipe: str = ""
    stream: str = ""
    state: str = "streaming"
    predicted: float | None = None
    speedups: dict[str, float] = field(default_factory=dict)
    gates: dict[str, bool] = field(default_factory=dict)
    gate_details: dict[str, str] = field(default_factory=dict)
    failure: str = ""
    decision: str = ""
    note: str = ""

    @property
    def measured(self) -> float | None:
        """Held-out speedup when measured, else the tuning one."""
        return self.speedups.get("heldout", self.speedups.get("tuning"))

    @property
    def failed_gate(self) -> str | None:
        return next((g for g in GATES if self.gates.get(g) is False), None)

    @property
    def gate_marks(self) -> str:
        """One symbol per gate in order: ✓ passed, ✗ failed, · not run (yet)."""
        return "".join({True: "✓", False: "✗"}.get(self.gates.get(g), "·") for g in GATES)

    @property
    def text(self) -> str:
        """What the diff view shows: the finished proposal, or the stream while it is arriving."""
        if not self.diff:
            return self.stream
        head = f"# {self.title}\n" if self.title else ""
        why = f"{self.rationale}\n" if self.rationale else ""
        return f"{head}{why}\n{self.diff}" if head or why else self.diff


@dataclass
class ForcingView:
    """A token-forcing result for one candidate."""

    cid: str
    tokens: int
    mismatches: int | None  # None when forcing could not score the outputs (error says why)
    rate: float
    near_ties: int | None
    threshold: float
    passed: bool
    error: str | None = None


@dataclass
class IncumbentPoint:
    """The incumbent at the end of one round, with the reference speedups."""

    round: int
    vs_ar: float
    vs_stock: float | None
    ceiling: float | None
    interval: Any = None
    stock: float | None = None

    @property
    def stock_vs_ar(self) -> float | None:
        """Stock's speedup over AR: as reported, else derived from the incumbent's two speedups."""
        if self.stock is not None:
            return self.stock
        if self.vs_stock is None or self.vs_stock <= 0:
            return None
        return self.vs_ar / self.vs_stock


@dataclass
class Alert:
    """A message for the user (notification and status line)."""

    severity: str
    message: str
    toast: bool = True  # notices stay on the status line only, so toasts never stack over the table


def short_name(path: Any) -> str:
    """The last component of a model path, for the header."""
    text = str(path or "").rstrip("/")
    return PurePath(text).name if text else "—"


def model_names(dep: dict) -> str:
    """'target → drafter' for a stored deployment, by the files a user named (a GGUF's name, not its cache)."""
    target = dep.get("target_source") or dep.get("target")
    drafter = (dep.get("drafter_source") or dep.get("drafter")) if dep.get("drafter") else None
    return f"{short_name(target)} → {short_name(drafter)}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class DashboardState:
    """Everything the panels render, built only by `apply`."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock  # set for a live dashboard: a step's elapsed time runs on between events
        self._progress_at: float | None = None
        self._handlers: dict[str, Callable[[Any], set[str]]] = {
            cls.KIND: getattr(self, f"_on_{cls.KIND}") for cls in ev.EVENTS}
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new run starts, or a replay reloads)."""
        self.run: Any = None
        self.deployment: dict[str, Any] = {}
        self.agents: list[str] = []
        self.auto = False
        self.round: int | None = None
        self.loop_state = "starting"
        self.progress: dict[str, Any] | None = None
        self.run_status: str | None = None
        self.quitting: str | None = None  # what quitting waits for, once `q` was pressed
        self.gaps: GapView | None = None
        self.candidates: dict[str, CandidateView] = {}
        self.forcing: dict[str, ForcingView] = {}
        self.incumbents: list[IncumbentPoint] = []
        self.status: Alert | None = None
        self.alerts: list[Alert] = []
        self.summary: Any = None
        self.events_seen = 0

    @property
    def best_speedup(self) -> float | None:
        """Best incumbent held-out speedup over AR so far."""
        return max((p.vs_ar for p in self.incumbents), default=None)

    def apply(self, event: Event) -> set[str]:
        """Fold one event into the state; return the panels that changed."""
        self.events_seen += 1
        try:
            body = event.body
        except ev.MalformedEvent as exc:
            return self._alert("warning", f"{_one_line(exc)}; event ignored")
        try:
            return self._handlers[body.KIND](body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return self._alert("warning", f"malformed {event.kind} event ignored ({type(exc).__name__}: "
                                          f"{_one_line(exc)})")

    def apply_all(self, events: list[Event]) -> set[str]:
        """Apply events in order; return the union of changed panels."""
        changed: set[str] = set()
        for event in events:
            changed |= self.apply(event)
        return changed

    def take_alerts(self) -> list[Alert]:
        """Alerts raised since the last call (the UI turns them into notifications)."""
        alerts, self.alerts = self.alerts, []
        return alerts

    def awaiting(self) -> list[str]:
        """Candidates waiting for a decision, in arrival order."""
        return [c.cid for c in self.candidates.values() if c.state == "awaiting"]

    def refusal(self, cid: str | None, decision: str) -> str | None:
        """Why `decision` on `cid` cannot be taken now (None when it can)."""
        if cid is None:
            return "no candidate selected"
        cand = self.candidates.get(cid)
        if cand is None:
            return f"unknown candidate {cid}"
        gate = cand.failed_gate
        if decision == "approve" and gate:
            return f"cannot approve {cid}: it failed the {gate} gate"
        if decision == "approve" and cand.state == "agent failed":
            return f"cannot approve {cid}: the agent failed ({cand.failure})"
        if cand.state != "awaiting":
            return f"cannot {decision} {cid}: it is not awaiting a decision (state: {cand.state})"
        return None

    def _alert(self, severity: str, message: str, toast: bool = True) -> set[str]:
        alert = Alert(severity, message, toast)
        self.status = alert
        self.alerts.append(alert)
        return {"status"}

    def _cand(self, cid: Any) -> CandidateView:
        cid = str(cid)
        if cid not in self.candidates:
            self.candidates[cid] = CandidateView(cid)
        return self.candidates[cid]

    def _on_run_started(self, e: ev.RunStarted) -> set[str]:
        self.reset()
        self.run = e.run
        self.deployment = dict(e.deployment)
        self.agents = list(e.agents)
        self.auto = e.auto
        self.events_seen = 1
        return set(PANELS)

    def _on_round_started(self, e: ev.RoundStarted) -> set[str]:
        self.round = e.round
        self.candidates.clear()
        self.forcing.clear()
        return {"header", "candidates", "stream", "forcing"}

    def _on_state(self, e: ev.StateChanged) -> set[str]:
        if e.state != "paused":
            self.progress = None  # a new phase: the last step's progress is over
        self.loop_state = e.state
        return {"header", "status"}

    def _on_progress(self, e: ev.Progress) -> set[str]:
        self.progress = {"step": e.step, "done": e.done, "total": e.total, "elapsed_s": e.elapsed_s,
                         "eta_s": e.eta_s}
        self._progress_at = self.clock() if self.clock else None
        return {"status"}

    def current_progress(self) -> dict[str, Any] | None:
        """The step in flight with its clock run on to now (live only: a replay shows it as stored)."""
        if self.progress is None or not self.clock or self._progress_at is None:
            return self.progress
        late = max(0.0, self.clock() - self._progress_at)
        eta = self.progress["eta_s"]
        return {**self.progress, "elapsed_s": self.progress["elapsed_s"] + late,
                "eta_s": None if eta is None else max(0.0, eta - late)}

    def _on_agent_done(self, e: ev.AgentDone) -> set[str]:
        cand = self._cand(e.cid)
        cand.title = e.title or cand.title
        if cand.state == "streaming":
            cand.state = "queued"
        return {"candidates"}

    def _on_gaps(self, e: ev.Gaps) -> set[str]:
        gaps = [(str(g["component"]), float(g["ms_per_token"])) for g in e.gaps]
        largest = e.largest_gap or (max(gaps, key=lambda g: g[1])[0] if gaps else "")
        drift = describe_drift(e.drift, short=True) if e.drift else ""
        self.gaps = GapView(e.round, e.measured_tokens_per_s, e.ceiling_tokens_per_s, gaps, largest, drift)
        return {"gaps"}

    def _on_agent_started(self, e: ev.AgentStarted) -> set[str]:
        cand = self._cand(e.cid)
        cand.agent = e.agent or cand.agent
        cand.direction = e.direction
        cand.state = "streaming"
        return {"candidates", "stream"}

    def _on_agent_chunk(self, e: ev.AgentChunk) -> set[str]:
        self._cand(e.cid).stream += e.text
        return {"stream"}

    def _on_candidate(self, e: ev.CandidateProposed) -> set[str]:
        cand = self._cand(e.cid)
        cand.agent = e.agent or cand.agent
        cand.title, cand.rationale, cand.kind = e.title, e.rationale, e.kind
        cand.diff, cand.recipe, cand.predicted = e.diff, e.recipe, e.predicted_speedup
        cand.state = "proposed"
        return {"candidates", "stream"}

    def _on_candidate_failed(self, e: ev.CandidateFailed) -> set[str]:
        cand = self._cand(e.cid)
        cand.agent = e.agent or cand.agent
        cand.failure = e.reason
        cand.state = "agent failed"
        return {"candidates", "stream"} | self._alert(
            "warning", f"agent {cand.agent or '?'} failed on {cand.cid}: {cand.failure}")

    def _on_gate(self, e: ev.GateChecked) -> set[str]:
        cand = self._cand(e.cid)
        cand.gates[e.gate] = e.passed
        cand.gate_details[e.gate] = e.detail
        if not e.passed:
            cand.state = f"failed {e.gate}"
        elif e.gate == GATES[-1]:
            cand.state = "passed"
        elif cand.state in ("proposed", "streaming", "judging"):
            cand.state = "judging"
        return {"candidates"}

    def _on_forcing(self, e: ev.Forced) -> set[str]:
        self.forcing[e.cid] = ForcingView(e.cid, e.tokens, e.mismatches, e.rate, e.near_ties, e.threshold, e.passed,
                                          e.error)
        self._cand(e.cid)
        changed = {"forcing", "candidates"}
        if e.error:
            changed |= self._alert("error", f"{e.cid}: {e.error}")
        return changed

    def _on_evaluation(self, e: ev.Evaluated) -> set[str]:
        self._cand(e.cid).speedups[e.split] = e.speedup
        return {"candidates"}

    def _on_awaiting_decision(self, e: ev.AwaitingDecision) -> set[str]:
        self._cand(e.cid).state = "awaiting"
        return {"candidates"}

    def _on_decision(self, e: ev.Decided) -> set[str]:
        cand = self._cand(e.cid)
        cand.decision, cand.note = e.decision, e.note
        cand.state = {"approve": "approved", "reject": "rejected"}.get(cand.decision, cand.decision)
        return {"candidates"}

    def _on_incumbent(self, e: ev.NewIncumbent) -> set[str]:
        point = IncumbentPoint(e.round if e.round is not None else self.round or 0, e.heldout_speedup_vs_ar,
                               e.heldout_speedup_vs_stock, e.ceiling_speedup_vs_ar, e.interval, e.stock_speedup_vs_ar)
        self.incumbents = [q for q in self.incumbents if q.round != point.round] + [point]
        self.incumbents.sort(key=lambda q: q.round)
        return {"speedup", "header"}

    def _on_round_finished(self, e: ev.RoundFinished) -> set[str]:
        self.round = e.round if e.round is not None else self.round or 0
        return {"header"}

    def _on_run_finished(self, e: ev.RunFinished) -> set[str]:
        self.summary = e.summary
        self.run_status = e.status
        best = self.best_speedup
        tail = f": best {best:.2f}x over AR" if best is not None else ""
        reason = self.summary.get("reason") if isinstance(self.summary, dict) else None
        if self.run_status != "finished" and reason:
            tail += f" ({reason})"
        run = e.run if e.run is not None else self.run
        return {"header"} | self._alert("information", f"run {run} {self.run_status}{tail}")

    def _on_notice(self, e: ev.Notice) -> set[str]:
        return self._alert("information", e.message, toast=False)

    def _on_error(self, e: ev.Error) -> set[str]:
        return self._alert("error", e.message)
