"""A scripted core for UI tests: implements LoopHandle and emits a realistic, deterministic run.

Per round: measuring -> gaps -> three agents (one streams a good diff, one a lossy diff that fails
token forcing, one fails outright; `lossy_first` puts the lossy one in the first row) -> gates, forcing
and evaluations -> the good candidate awaits a decision and the loop blocks until decide() (or stop()).
Pause/resume are honoured at every step boundary. Decisions are recorded; approving a failed or
non-waiting candidate raises DecisionRefused.
`save_run` persists a recorded run into a real core.store.db.Store, as the loop would.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from specpilot.core.events import GATES, DecisionRefused, Emit, Event

T0 = 1_700_000_000.0
STEP_S = 0.05
DEPLOYMENT = {"target": "models/demo-target", "drafter": "models/demo-drafter", "device": "cpu",
              "dtype": "bfloat16", "workload": "workloads/demo.jsonl"}
STOCK_VS_AR = 1.80
CEILING_VS_AR = 3.10

GOOD_DIFFS = (
    ("Wider dynamic tree", "tree", "The verify step is memory-bound; a wider tree costs little and "
     "locks in more tokens per check.",
     "--- a/recipe.toml\n+++ b/recipe.toml\n@@ -9,5 +9,5 @@\n [tree]\n-policy = \"chain\"\n"
     "+policy = \"dynamic\"\n depth = 4\n-budget = 16\n+budget = 32\n topk = 4\n", 1.18, 1.19),
    ("Deeper chain after the wide tree", "tree", "Acceptance stays high past depth 4 on this workload.",
     "--- a/recipe.toml\n+++ b/recipe.toml\n@@ -10,4 +10,4 @@\n policy = \"dynamic\"\n-depth = 4\n"
     "+depth = 6\n budget = 32\n topk = 4\n", 1.12, 1.15),
)
LOSSY_DIFF = ("--- a/recipe.toml\n+++ b/recipe.toml\n@@ -15,3 +15,3 @@\n [verify]\n"
              "-sampling = \"greedy\"\n+sampling = \"lossy_top2\"\n temperature = 1.0\n")


def chunks(text: str, size: int = 24) -> list[str]:
    """Split `text` the way an agent's stream arrives."""
    return [text[i:i + size] for i in range(0, len(text), size)]


class Stopped(Exception):
    """Raised inside run() when stop() was called."""


class FakeCore:
    """LoopHandle with a scripted run; thread-safe; records decisions and control calls."""

    def __init__(self, rounds: int = 2, delay: float = 0.0, auto: bool = False, refuse_all: bool = False,
                 hold_after_round: int | None = None, fail_with: str | None = None,
                 lossy_first: bool = False) -> None:
        self.rounds = rounds
        self.lossy_first = lossy_first
        self.delay = delay
        self.auto = auto
        self.refuse_all = refuse_all
        self.fail_with = fail_with
        self.decisions: list[tuple[str, str, str]] = []
        self.calls: list[str] = []
        self.events: list[Event] = []
        self.awaiting: set[str] = set()
        self.failed: dict[str, str] = {}
        self.hold_after_round = hold_after_round
        self.release = threading.Event()
        self.held = threading.Event()
        self.finished = threading.Event()
        self._cond = threading.Condition()
        self._paused = False
        self._stopped = False
        self._emit: Emit | None = None
        self._round = 0
        self._state = "idle"
        self._speedup = STOCK_VS_AR

    def run(self, emit: Emit) -> None:
        self._emit = emit
        try:
            self._send("run_started", run=1, deployment=DEPLOYMENT, agents=["local:0", "local:1", "local:2"],
                       auto=self.auto)
            for r in range(1, self.rounds + 1):
                self._round_script(r)
                if self.hold_after_round == r:
                    self.held.set()
                    self._wait_for(self.release.is_set)
            self._set_state("done")
            self._send("run_finished", run=1, summary={"rounds": self.rounds, "best": round(self._speedup, 3)})
        except Stopped:
            pass
        finally:
            self.finished.set()

    def decide(self, cid: str, decision: str, note: str = "") -> None:
        with self._cond:
            if self.refuse_all:
                raise DecisionRefused(f"the core refused to {decision} {cid}")
            if decision == "approve" and cid in self.failed:
                raise DecisionRefused(f"{cid} failed {self.failed[cid]}; only candidates that pass every "
                                      "gate can be approved")
            if cid not in self.awaiting:
                raise DecisionRefused(f"{cid} is not awaiting a decision")
            self.awaiting.discard(cid)
            self.decisions.append((cid, decision, note))
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self.calls.append("pause")
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.calls.append("resume")
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.calls.append("stop")
            self._stopped = True
            self._cond.notify_all()
        self.release.set()

    def _round_script(self, r: int) -> None:
        title, direction, rationale, diff, predicted, heldout = GOOD_DIFFS[(r - 1) % len(GOOD_DIFFS)]
        good, lossy, broken = (f"c{3 * r - 2}", f"c{3 * r - 1}", f"c{3 * r}")
        if self.lossy_first:
            good, lossy = lossy, good
        self._round = r
        self._send("round_started", round=r)
        self._set_state("measuring")
        measured = 184.0 * self._speedup / STOCK_VS_AR
        self._send("gaps", round=r, measured_tokens_per_s=round(measured, 1), ceiling_tokens_per_s=331.2,
                   gaps=[{"component": "draft", "ms_per_token": 1.10 - 0.1 * r},
                         {"component": "verify", "ms_per_token": 2.35 - 0.4 * r},
                         {"component": "acceptance", "ms_per_token": 0.95},
                         {"component": "host overhead", "ms_per_token": 0.42},
                         {"component": "kv copy", "ms_per_token": 0.18}],
                   largest_gap="verify")
        self._set_state("proposing")
        proposals = [(good, "local:0", direction, title, rationale, diff, predicted),
                     (lossy, "local:1", "verify", "Accept top-2 at verification",
                      "Accepting the drafter's second choice raises acceptance.", LOSSY_DIFF, 1.31)]
        for proposal in reversed(proposals) if self.lossy_first else proposals:
            self._propose(*proposal)
        self._send("agent_started", cid=broken, agent="local:2", direction="draft")
        self._send("candidate_failed", cid=broken, agent="local:2", reason="no diff in the agent's answer")
        self.failed[broken] = "to propose a diff"
        self._set_state("judging")
        for gate in GATES[:2]:
            self._send("gate", cid=good, gate=gate, passed=True, detail="ok")
        self._send("forcing", cid=good, tokens=4096, mismatches=30, rate=30 / 4096, near_ties=27,
                   threshold=0.0122, passed=True)
        self._send("gate", cid=good, gate="forcing", passed=True, detail="0.73% <= 1.22%")
        self._send("evaluation", cid=good, split="tuning", speedup=heldout + 0.02, low=heldout - 0.04,
                   high=heldout + 0.08, passed=True)
        self._send("gate", cid=good, gate="tuning", passed=True, detail="paired p < 0.01")
        self._send("evaluation", cid=good, split="heldout", speedup=heldout, low=heldout - 0.05,
                   high=heldout + 0.05, passed=True)
        self._send("gate", cid=good, gate="heldout", passed=True, detail="interval above 1")
        for gate in GATES[:2]:
            self._send("gate", cid=lossy, gate=gate, passed=True, detail="ok")
        self._send("forcing", cid=lossy, tokens=4096, mismatches=82, rate=82 / 4096, near_ties=9,
                   threshold=0.0122, passed=False)
        self._send("gate", cid=lossy, gate="forcing", passed=False, detail="2.00% > 1.22% limit")
        self.failed[lossy] = "the forcing gate"
        decision = self._decision(good)
        self._send("decision", cid=good, decision=decision[0], note=decision[1], by=decision[2])
        if self.fail_with and r == self.rounds:
            raise RuntimeError(self.fail_with)
        if decision[0] == "approve":
            self._set_state("integrating")
            self._speedup *= heldout
        self._send("incumbent", round=r, recipe="name = \"incumbent\"\n", heldout_speedup_vs_ar=round(self._speedup, 3),
                   heldout_speedup_vs_stock=round(self._speedup / STOCK_VS_AR, 3),
                   interval=[round(self._speedup * 0.97, 3), round(self._speedup * 1.03, 3)],
                   ceiling_speedup_vs_ar=CEILING_VS_AR)
        self._send("round_finished", round=r)

    def _propose(self, cid: str, agent: str, direction: str, title: str, rationale: str, diff: str,
                 predicted: float) -> None:
        self._send("agent_started", cid=cid, agent=agent, direction=direction)
        for piece in chunks(f"Looking at the {direction} gap.\n{diff}"):
            self._send("agent_chunk", cid=cid, text=piece)
        self._send("candidate", cid=cid, agent=agent, title=title, rationale=rationale, kind="recipe", diff=diff,
                   recipe="", predicted_speedup=predicted)

    def _decision(self, cid: str) -> tuple[str, str, str]:
        if self.auto:
            return ("approve", "", "auto")
        with self._cond:
            self.awaiting.add(cid)
        self._send("awaiting_decision", cid=cid)
        self._set_state("awaiting_approval")
        self._wait_for(lambda: any(d[0] == cid for d in self.decisions))
        _, decision, note = next(d for d in reversed(self.decisions) if d[0] == cid)
        return (decision, note, "user")

    def _wait_for(self, ready: Any) -> None:
        with self._cond:
            while not ready():
                if self._stopped:
                    raise Stopped
                self._cond.wait(0.05)

    def _set_state(self, state: str) -> None:
        self._state = state
        self._send("state", state=state)

    def _checkpoint(self) -> None:
        """A step boundary: honour stop and pause (emitting `paused` and the state resumed to)."""
        with self._cond:
            if self._stopped:
                raise Stopped
            if not self._paused:
                return
        self._raw("state", {"state": "paused"})
        with self._cond:
            while self._paused and not self._stopped:
                self._cond.wait(0.05)
            if self._stopped:
                raise Stopped
        self._raw("state", {"state": self._state})

    def _send(self, kind: str, /, **payload: Any) -> None:
        self._checkpoint()
        if self.delay:
            with self._cond:
                self._cond.wait(self.delay)
        self._raw(kind, payload)

    def _raw(self, kind: str, payload: dict[str, Any]) -> None:
        seq = len(self.events) + 1
        event = Event(kind, payload, run=1, round=self._round or None, seq=seq, time=T0 + STEP_S * seq)
        self.events.append(event)
        assert self._emit is not None
        self._emit(event)


def from_env() -> "FakeCore":
    """The scripted core the tmux tests start the dashboard on (SPECPILOT_LOOP_FACTORY=fake_core:from_env), paced
    by SPECPILOT_FAKE_DELAY seconds per event."""
    return FakeCore(delay=float(os.environ.get("SPECPILOT_FAKE_DELAY", "0.02")))


def record(rounds: int = 2, until_awaiting: bool = False) -> list[Event]:
    """The events of a scripted run: complete and auto-approved, or cut when round 1's candidate awaits."""
    core = FakeCore(rounds=rounds, auto=not until_awaiting)
    if not until_awaiting:
        core.run(lambda event: None)
        return core.events
    thread = threading.Thread(target=core.run, args=(lambda event: None,), daemon=True)
    thread.start()
    while not core.awaiting and thread.is_alive():
        time.sleep(0.005)
    core.stop()
    thread.join(5)
    return core.events


def save_run(store: Any, events: list[Event]) -> int:
    """Persist a recorded run the way the loop does (rounds and events) into a core.store.db.Store."""
    start = next(e for e in events if e.kind == "run_started")
    run_id = store.create_run(start.payload["deployment"], {"agents": start.payload["agents"]})
    round_ids: dict[int, int] = {}
    incumbent: dict[str, Any] = {}
    for event in events:
        if event.kind == "round_started":
            round_ids[event.payload["round"]] = store.start_round(run_id, event.payload["round"], {})
        elif event.kind == "candidate":
            p = event.payload
            store.add_candidate(round_ids[max(round_ids)], p["cid"], p["agent"], p["title"], p["rationale"],
                                p["kind"], p["diff"], p["recipe"], p["predicted_speedup"])
        elif event.kind == "incumbent":
            incumbent = dict(event.payload)
        elif event.kind == "round_finished":
            store.finish_round(round_ids[event.payload["round"]], incumbent)
        store.append_event(run_id, event)
    if events[-1].kind == "run_finished":
        store.finish_run(run_id, "finished", events[-1].payload.get("summary", {}))
    return run_id
