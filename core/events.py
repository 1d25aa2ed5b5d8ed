"""Typed events the loop emits; the store persists them and the UI renders them.

Every event has a `kind` and a JSON-serialisable `payload`. Replay feeds stored events back through the
same handlers as live ones, so the payloads below are the whole contract between core and UI.

Kinds and payload keys:
  run_started      run, deployment {target, drafter, device, dtype, workload}, agents [str], auto
  round_started    round
  state            state: preparing|measuring|proposing|judging|awaiting_approval|integrating|paused|done|
                   stopped|failed
  progress         state, step, done, total (None when unknown), elapsed_s, eta_s (None until known)
  gaps             round, measured_tokens_per_s, ceiling_tokens_per_s, gaps [{component, ms_per_token}],
                   largest_gap
  agent_started    cid, agent, direction
  agent_chunk      cid, text                  (streamed reasoning and diff text, in order)
  agent_done       cid, agent, title          (the proposal is complete; it waits for the judge)
  candidate        cid, agent, title, rationale, kind, diff, recipe (TOML text), predicted_speedup
  candidate_failed cid, agent, reason
  gate             cid, gate: applies|smoke|forcing|tuning|heldout, passed, detail
  forcing          cid, tokens, mismatches, rate, near_ties, threshold, passed
  evaluation       cid, split: tuning|heldout, speedup, low, high, passed
  awaiting_decision cid
  decision         cid, decision: approve|reject, note, by: auto|user
  incumbent        round, recipe (TOML text), heldout_speedup_vs_ar, heldout_speedup_vs_stock, interval,
                   ceiling_speedup_vs_ar
  round_finished   round
  run_finished     run, summary, status: finished|stopped|interrupted
  notice           message
  error            message
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

KINDS = (
    "run_started", "round_started", "state", "progress", "gaps", "agent_started", "agent_chunk", "agent_done",
    "candidate", "candidate_failed", "gate", "forcing", "evaluation", "awaiting_decision", "decision", "incumbent",
    "round_finished", "run_finished", "notice", "error",
)
GATES = ("applies", "smoke", "forcing", "tuning", "heldout")


@dataclass
class Event:
    """One thing that happened in a run, in order (`seq`) and with wall-clock time."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    run: int | None = None
    round: int | None = None
    seq: int = 0
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {', '.join(KINDS)}")


Emit = Callable[[Event], None]


class DecisionRefused(Exception):
    """Raised when a decision cannot be taken (e.g. approving a candidate that failed a gate)."""


class LoopHandle(Protocol):
    """What the UI drives: the real loop and the scripted fake core in tests both implement it."""

    def run(self, emit: Emit) -> None:
        """Run the loop to completion in the calling (worker) thread, emitting events."""

    def decide(self, cid: str, decision: str, note: str = "") -> None:
        """Approve or reject a waiting candidate; raises DecisionRefused when not allowed."""

    def pause(self) -> None:
        """Pause between steps (the step in flight finishes)."""

    def resume(self) -> None:
        """Resume after pause."""

    def stop(self) -> None:
        """Ask the loop to end at the next step boundary."""
