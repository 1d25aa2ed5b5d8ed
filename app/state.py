"""The dashboard's state model: pure Python, fed one event at a time.

`DashboardState.apply(event)` is the single dispatcher for everything the UI shows. Live events from
the loop and events read back from the store (replay) go through it alike; widgets only read the
state. `apply` returns the names of the panels that changed (see PANELS) so the UI refreshes only those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Callable

from core.events import GATES, Event

PANELS = ("header", "gaps", "candidates", "stream", "forcing", "speedup", "status")


@dataclass
class GapView:
    """The latest cost-model gap breakdown."""

    round: int | None
    measured_tokens_per_s: float
    ceiling_tokens_per_s: float
    gaps: list[tuple[str, float]]
    largest: str


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
    mismatches: int
    rate: float
    near_ties: int
    threshold: float
    passed: bool


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


def _num(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


class DashboardState:
    """Everything the panels render, built only by `apply`."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock  # set for a live dashboard: a step's elapsed time runs on between events
        self._progress_at: float | None = None
        self._handlers: dict[str, Callable[[dict[str, Any]], set[str]]] = {
            "run_started": self._run_started,
            "round_started": self._round_started,
            "state": self._state,
            "progress": self._progress,
            "agent_done": self._agent_done,
            "gaps": self._gaps,
            "agent_started": self._agent_started,
            "agent_chunk": self._agent_chunk,
            "candidate": self._candidate,
            "candidate_failed": self._candidate_failed,
            "gate": self._gate,
            "forcing": self._forcing,
            "evaluation": self._evaluation,
            "awaiting_decision": self._awaiting,
            "decision": self._decision,
            "incumbent": self._incumbent,
            "round_finished": self._round_finished,
            "run_finished": self._run_finished,
            "notice": self._notice,
            "error": self._error,
        }
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
        handler = self._handlers.get(event.kind)
        if handler is None:
            return set()
        try:
            return handler(event.payload or {})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return self._alert("warning", f"malformed {event.kind} event ignored ({type(exc).__name__}: {exc})")

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

    def _run_started(self, p: dict[str, Any]) -> set[str]:
        self.reset()
        self.run = p.get("run")
        self.deployment = dict(p.get("deployment") or {})
        self.agents = list(p.get("agents") or [])
        self.auto = bool(p.get("auto", False))
        self.events_seen = 1
        return set(PANELS)

    def _round_started(self, p: dict[str, Any]) -> set[str]:
        self.round = int(p["round"])
        self.candidates.clear()
        self.forcing.clear()
        return {"header", "candidates", "stream", "forcing"}

    def _state(self, p: dict[str, Any]) -> set[str]:
        state = str(p["state"])
        if state != "paused":
            self.progress = None  # a new phase: the last step's progress is over
        self.loop_state = state
        return {"header", "status"}

    def _progress(self, p: dict[str, Any]) -> set[str]:
        self.progress = {"step": str(p["step"]), "done": int(p.get("done") or 0), "total": p.get("total"),
                         "elapsed_s": _num(p.get("elapsed_s")) or 0.0, "eta_s": _num(p.get("eta_s"))}
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

    def _agent_done(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.title = str(p.get("title") or cand.title)
        if cand.state == "streaming":
            cand.state = "queued"
        return {"candidates"}

    def _gaps(self, p: dict[str, Any]) -> set[str]:
        gaps = [(str(g["component"]), float(g["ms_per_token"])) for g in p.get("gaps", [])]
        largest = p.get("largest_gap") or (max(gaps, key=lambda g: g[1])[0] if gaps else "")
        self.gaps = GapView(p.get("round"), float(p.get("measured_tokens_per_s") or 0.0),
                            float(p.get("ceiling_tokens_per_s") or 0.0), gaps, str(largest))
        return {"gaps"}

    def _agent_started(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.agent = str(p.get("agent", cand.agent))
        cand.direction = str(p.get("direction", ""))
        cand.state = "streaming"
        return {"candidates", "stream"}

    def _agent_chunk(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.stream += str(p.get("text", ""))
        return {"stream"}

    def _candidate(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.agent = str(p.get("agent", cand.agent))
        cand.title = str(p.get("title", ""))
        cand.rationale = str(p.get("rationale", ""))
        cand.kind = str(p.get("kind", ""))
        cand.diff = str(p.get("diff", ""))
        cand.recipe = str(p.get("recipe", ""))
        cand.predicted = _num(p.get("predicted_speedup"))
        cand.state = "proposed"
        return {"candidates", "stream"}

    def _candidate_failed(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.agent = str(p.get("agent", cand.agent))
        cand.failure = str(p.get("reason", ""))
        cand.state = "agent failed"
        return {"candidates", "stream"} | self._alert(
            "warning", f"agent {cand.agent or '?'} failed on {cand.cid}: {cand.failure}")

    def _gate(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        gate, passed = str(p["gate"]), bool(p["passed"])
        cand.gates[gate] = passed
        cand.gate_details[gate] = str(p.get("detail", ""))
        if not passed:
            cand.state = f"failed {gate}"
        elif gate == GATES[-1]:
            cand.state = "passed"
        elif cand.state in ("proposed", "streaming", "judging"):
            cand.state = "judging"
        return {"candidates"}

    def _forcing(self, p: dict[str, Any]) -> set[str]:
        cid = str(p["cid"])
        self.forcing[cid] = ForcingView(cid, int(p["tokens"]), int(p["mismatches"]), float(p["rate"]),
                                        int(p.get("near_ties", 0)), float(p["threshold"]), bool(p["passed"]))
        self._cand(cid)
        return {"forcing", "candidates"}

    def _evaluation(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.speedups[str(p["split"])] = float(p["speedup"])
        return {"candidates"}

    def _awaiting(self, p: dict[str, Any]) -> set[str]:
        self._cand(p["cid"]).state = "awaiting"
        return {"candidates"}

    def _decision(self, p: dict[str, Any]) -> set[str]:
        cand = self._cand(p["cid"])
        cand.decision = str(p["decision"])
        cand.note = str(p.get("note", ""))
        cand.state = {"approve": "approved", "reject": "rejected"}.get(cand.decision, cand.decision)
        return {"candidates"}

    def _incumbent(self, p: dict[str, Any]) -> set[str]:
        point = IncumbentPoint(int(p.get("round", self.round or 0)), float(p["heldout_speedup_vs_ar"]),
                               _num(p.get("heldout_speedup_vs_stock")), _num(p.get("ceiling_speedup_vs_ar")),
                               p.get("interval"), _num(p.get("stock_speedup_vs_ar")))
        self.incumbents = [q for q in self.incumbents if q.round != point.round] + [point]
        self.incumbents.sort(key=lambda q: q.round)
        return {"speedup", "header"}

    def _round_finished(self, p: dict[str, Any]) -> set[str]:
        self.round = int(p.get("round", self.round or 0))
        return {"header"}

    def _run_finished(self, p: dict[str, Any]) -> set[str]:
        self.summary = p.get("summary")
        self.run_status = str(p.get("status") or "finished")
        best = self.best_speedup
        tail = f": best {best:.2f}x over AR" if best is not None else ""
        reason = (self.summary or {}).get("reason") if isinstance(self.summary, dict) else None
        if self.run_status != "finished" and reason:
            tail += f" ({reason})"
        return {"header"} | self._alert("information", f"run {p.get('run', self.run)} {self.run_status}{tail}")

    def _notice(self, p: dict[str, Any]) -> set[str]:
        return self._alert("information", str(p.get("message", "")), toast=False)

    def _error(self, p: dict[str, Any]) -> set[str]:
        return self._alert("error", str(p.get("message", "")))
