"""Thread control of a run: pause, resume, stop, abort and decisions arrive from the UI thread (or a
signal) while the loop runs in its own; the loop acts on them only at step boundaries."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from specpilot.core import progress
from specpilot.core.events import AwaitingDecision, Decided, DecisionRefused, Notice, Progress, StateChanged
from specpilot.core.loop.record import EventLog
from specpilot.core.recipe import Recipe
from specpilot.core.workers import kill_workers

PROGRESS_EVERY_S = 1.0  # a long step's progress is stored at most this often (and at its start and end)


@dataclass
class Pending:
    """A judged candidate of the round in flight, until its decision is taken and recorded."""

    cid: str
    recipe: Recipe
    passed: bool
    failed_gate: str | None
    verdict: Any = None
    candidate: Any = None
    decision: str | None = None
    recorded: bool = False  # the decision is stored and its event emitted: the loop may act on it
    note: str = ""


class Control:
    """The run's state between threads; the loop (core/loop/rounds.py) builds on it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.log = EventLog(store)
        self._current = "measuring"
        self._lock = threading.Lock()
        self._decided = threading.Condition(self._lock)
        self._pending: dict[str, Pending] = {}
        self._running = threading.Event()
        self._running.set()
        self._stop = False
        self._abort: str | None = None  # why the step in flight is being abandoned (quit, a signal)
        self._step: progress.Step | None = None
        self._last_progress: tuple[str | None, float] = (None, 0.0)

    @property
    def run_id(self) -> int | None:
        """The stored run (None until it starts); every event is recorded against it."""
        return self.log.run_id

    @run_id.setter
    def run_id(self, value: int | None) -> None:
        self.log.run_id = value

    @property
    def round(self) -> int:
        """The round in flight (0 before the first)."""
        return self.log.round

    @round.setter
    def round(self, value: int) -> None:
        self.log.round = value

    def pause(self) -> None:
        """Pause at the next step boundary (the step in flight finishes)."""
        if not self._running.is_set() or self._current in ("done", "failed"):
            return
        self._running.clear()
        self.log(StateChanged("paused"))

    def resume(self) -> None:
        """Carry on after pause, in the state the pause interrupted."""
        if self._running.is_set():
            return
        self.log(Notice("resumed"))
        self.log(StateChanged(self._current))
        self._running.set()

    def stop(self) -> None:
        """End the run at the next step boundary: candidates not yet judged are skipped, the round in flight
        is finished with what was decided, and the run is stored as stopped."""
        with self._decided:
            self._stop = True
            self._decided.notify_all()
        if self.run_id is not None and self._current not in ("done", "failed") and not self._abort:
            self.log(Notice("stopping at the next step boundary"))
        self._running.set()

    def abort(self, why: str = "quit") -> None:
        """End the run now: the step in flight is abandoned at its next request (its workers killed), the
        round in flight is not counted, and the run is stored as stopped (or interrupted, for a signal)."""
        if self._abort is None:
            self._abort = why
            if self.run_id is not None and self._current not in ("done", "failed"):
                step = self._step.name if self._step is not None else self._current
                self.log(Notice(f"{why}: stopping {step} (workers are killed)"))
        self.stop()

    def kill_workers(self) -> int:
        """Kill the loop's workers now, whatever step they are in (a dashboard leaving without waiting for
        the step to end); returns how many there were."""
        return kill_workers()

    @property
    def waiting_for(self) -> str:
        """What the loop is doing right now, in words (what quitting waits for)."""
        return self._step.name if self._step is not None else self._current

    def decide(self, cid: str, decision: str, note: str = "") -> None:
        """Approve or reject a waiting candidate; approval never overrides a failed gate."""
        if decision not in ("approve", "reject"):
            raise DecisionRefused(f"decision must be approve or reject, not {decision!r}")
        with self._decided:
            p = self._pending.get(cid)
            if p is None:
                raise DecisionRefused(f"candidate {cid} is not waiting for a decision")
            if decision == "approve" and not p.passed:
                raise DecisionRefused(f"candidate {cid} failed the {p.failed_gate} gate; approval cannot override "
                                      "a failed gate")
            if p.decision is not None:
                raise DecisionRefused(f"candidate {cid} was already decided ({p.decision})")
            p.decision, p.note = decision, note  # claimed: a second decision is refused from here on
        try:
            self.store.add_decision(cid, decision, note, "user")
            self.log(Decided(cid, decision, note, "user"))
        except Exception:
            with self._decided:
                p.decision = None
            raise
        with self._decided:
            p.recorded = True
            self._decided.notify_all()

    def await_decisions(self, pending: list[Pending], auto: bool) -> list[Pending]:
        """The candidates approved among those that passed every gate: all of them with `auto`, else
        those a person approves (the loop waits here until each is decided, or the run stops)."""
        waiting = [p for p in pending if p.passed]
        if not waiting:
            return []
        if auto:
            for p in waiting:
                p.decision = "approve"
                self.store.add_decision(p.cid, "approve", "passed every gate", "auto")
                self.log(Decided(p.cid, "approve", "passed every gate", "auto"))
            return waiting
        with self._decided:
            for p in pending:
                self._pending[p.cid] = p
        self._state("awaiting_approval")
        for p in waiting:
            self.log(AwaitingDecision(p.cid))
        with self._decided:
            while not self._stop and any(not p.recorded for p in waiting):
                self._decided.wait(timeout=0.5)
            for p in pending:
                self._pending.pop(p.cid, None)
            return [p for p in waiting if p.recorded and p.decision == "approve"]

    def _state(self, state: str) -> None:
        self._current, self._step = state, None
        self.log(StateChanged(state))

    def _checkpoint(self) -> None:
        """Between steps: wait while paused; an aborted run goes no further."""
        if not self._running.is_set():
            self._running.wait()
        progress.check()

    def _progress(self, step: progress.Step) -> None:
        """A long step's progress as a `progress` event: at its start, its end, and every PROGRESS_EVERY_S."""
        self._step = step
        name, last = self._last_progress
        now = time.monotonic()
        if name == step.name and step.done not in (0, step.total) and now - last < PROGRESS_EVERY_S:
            return
        self._last_progress = (step.name, now)
        self.log(Progress.from_payload({"state": self._current, **step.payload()}))
