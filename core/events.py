"""Typed events the loop emits; the store persists them and the UI renders them.

One frozen dataclass per event kind; EVENTS is the one list of them. The loop emits instances, the store
keeps each one's payload (`to_payload()`, JSON), and replay parses stored payloads back (`parse`) into the
same classes before the same handlers render them, so the classes below are the whole contract between
core and UI. Fields added after a store was written have defaults, so old runs still replay; a stored
event that no longer parses raises MalformedEvent with a one-line reason, which the UI shows as a notice.
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, Protocol, Union

GATES = ("applies", "smoke", "forcing", "tuning", "heldout")
"""The judge's gates, in the order it runs them (cheapest first)."""
STATES = ("preparing", "measuring", "proposing", "judging", "awaiting_approval", "integrating", "paused", "done",
          "stopped", "failed")


class MalformedEvent(ValueError):
    """A stored or received event that does not match its kind's fields; the message is one line."""


@dataclass(frozen=True)
class EventBody:
    """The typed part of one event; each subclass names its KIND and declares its fields."""

    KIND: ClassVar[str] = ""

    def to_payload(self) -> dict[str, Any]:
        """The JSON-ready dict the store keeps (one key per field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_payload(cls, payload: Any) -> EventBody:
        """Parse a stored payload: unknown keys are ignored, absent fields with a default take it, scalars
        are coerced to the declared type; anything else raises MalformedEvent."""
        if not isinstance(payload, dict):
            raise MalformedEvent(f"{cls.KIND} event: payload is {type(payload).__name__}, not an object")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            value = payload.get(f.name)
            if value is None and not (f.name in payload and _optional(hints[f.name])):
                if not has_default:
                    raise MalformedEvent(f"{cls.KIND} event without {f.name}")
                continue
            values[f.name] = _coerce(cls.KIND, f.name, hints[f.name], value)
        return cls(**values)


def _optional(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _coerce(kind: str, name: str, hint: Any, value: Any) -> Any:
    """`value` as the field's declared type: scalars converted, containers checked, None where allowed."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is Any:
        return value
    origin = typing.get_origin(hint) or hint
    if origin in (list, dict):
        if not isinstance(value, origin):
            raise MalformedEvent(f"{kind} event: {name} must be a {origin.__name__}, got {type(value).__name__}")
        return value
    ok = isinstance(value, (bool, int)) if origin is bool else not isinstance(value, (bool, list, dict))
    try:
        if ok:
            return origin(value)
    except (TypeError, ValueError):
        pass
    raise MalformedEvent(f"{kind} event: {name} must be {origin.__name__}, got {value!r:.60}")


@dataclass(frozen=True)
class RunStarted(EventBody):
    KIND: ClassVar[str] = "run_started"
    run: int
    deployment: dict = field(default_factory=dict)  # target, drafter, device, dtype, workload
    agents: list = field(default_factory=list)
    auto: bool = False
    memory: int = 0  # validated mechanisms the run starts from
    resumed_after_round: int | None = None


@dataclass(frozen=True)
class RoundStarted(EventBody):
    KIND: ClassVar[str] = "round_started"
    round: int


@dataclass(frozen=True)
class StateChanged(EventBody):
    KIND: ClassVar[str] = "state"
    state: str  # one of STATES


@dataclass(frozen=True)
class Progress(EventBody):
    """A long step's progress (core/progress.py); total and eta_s are None until known."""

    KIND: ClassVar[str] = "progress"
    step: str
    state: str = ""
    done: int = 0
    total: int | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None


@dataclass(frozen=True)
class Gaps(EventBody):
    """The cost model's gap breakdown: gaps is [{component, ms_per_token}]; drift, under numerics other than
    f32, how far the deployment's greedy plain decoding is from transformers float32 (core/costmodel/drift.py,
    Drift.to_dict()), None under f32."""

    KIND: ClassVar[str] = "gaps"
    round: int | None = None
    measured_tokens_per_s: float = 0.0
    ceiling_tokens_per_s: float = 0.0
    gaps: list = field(default_factory=list)
    largest_gap: str = ""
    drift: dict | None = None


@dataclass(frozen=True)
class AgentStarted(EventBody):
    KIND: ClassVar[str] = "agent_started"
    cid: str
    agent: str = ""
    direction: str = ""


@dataclass(frozen=True)
class AgentChunk(EventBody):
    """Streamed reasoning and diff text, in order."""

    KIND: ClassVar[str] = "agent_chunk"
    cid: str
    text: str = ""


@dataclass(frozen=True)
class AgentDone(EventBody):
    """The proposal is complete; it waits for the judge."""

    KIND: ClassVar[str] = "agent_done"
    cid: str
    agent: str = ""
    title: str = ""


@dataclass(frozen=True)
class CandidateProposed(EventBody):
    """A candidate about to be judged; recipe is TOML text, kind is what it changes (recipe, plugin...)."""

    KIND: ClassVar[str] = "candidate"
    cid: str
    agent: str = ""
    title: str = ""
    rationale: str = ""
    kind: str = ""
    diff: str = ""
    recipe: str = ""
    predicted_speedup: float | None = None


@dataclass(frozen=True)
class CandidateFailed(EventBody):
    KIND: ClassVar[str] = "candidate_failed"
    cid: str
    agent: str = ""
    reason: str = ""


@dataclass(frozen=True)
class GateChecked(EventBody):
    KIND: ClassVar[str] = "gate"
    cid: str
    gate: str  # one of GATES
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class Forced(EventBody):
    """Token forcing of a candidate's outputs; when forcing could not score them, mismatches and
    near_ties are None and error says why."""

    KIND: ClassVar[str] = "forcing"
    cid: str
    tokens: int
    mismatches: int | None
    rate: float
    threshold: float
    passed: bool
    near_ties: int | None = 0
    error: str | None = None

    @classmethod
    def from_result(cls, cid: str, result: dict[str, Any]) -> Forced:
        """The event for one of the judge's forcing results (its keys are this class's fields)."""
        return cls.from_payload({**result, "cid": cid})  # type: ignore[return-value]


@dataclass(frozen=True)
class Evaluated(EventBody):
    """A timed A/B against the incumbent on one split (tuning or heldout)."""

    KIND: ClassVar[str] = "evaluation"
    cid: str
    split: str
    speedup: float
    low: float | None = None
    high: float | None = None
    passed: bool | None = None


@dataclass(frozen=True)
class AwaitingDecision(EventBody):
    KIND: ClassVar[str] = "awaiting_decision"
    cid: str


@dataclass(frozen=True)
class Decided(EventBody):
    KIND: ClassVar[str] = "decision"
    cid: str
    decision: str  # approve | reject
    note: str = ""
    by: str = "user"  # auto | user


@dataclass(frozen=True)
class NewIncumbent(EventBody):
    """The incumbent at the end of a round (recipe as TOML text), with its held-out standing."""

    KIND: ClassVar[str] = "incumbent"
    heldout_speedup_vs_ar: float
    round: int | None = None
    recipe: str = ""
    heldout_speedup_vs_stock: float | None = None
    interval: list | None = None
    ceiling_speedup_vs_ar: float | None = None
    stock_speedup_vs_ar: float | None = None
    workspace: str | None = None


@dataclass(frozen=True)
class RoundFinished(EventBody):
    KIND: ClassVar[str] = "round_finished"
    round: int | None = None


@dataclass(frozen=True)
class RunFinished(EventBody):
    KIND: ClassVar[str] = "run_finished"
    run: int | None = None
    summary: Any = None
    status: str = "finished"  # finished | stopped | interrupted


@dataclass(frozen=True)
class Notice(EventBody):
    KIND: ClassVar[str] = "notice"
    message: str = ""


@dataclass(frozen=True)
class Error(EventBody):
    KIND: ClassVar[str] = "error"
    message: str = ""


EVENTS: tuple[type[EventBody], ...] = (
    RunStarted, RoundStarted, StateChanged, Progress, Gaps, AgentStarted, AgentChunk, AgentDone, CandidateProposed,
    CandidateFailed, GateChecked, Forced, Evaluated, AwaitingDecision, Decided, NewIncumbent, RoundFinished,
    RunFinished, Notice, Error,
)
"""Every event kind; the dashboard's handlers and the store's replay derive from this list."""
BY_KIND: dict[str, type[EventBody]] = {cls.KIND: cls for cls in EVENTS}
KINDS = tuple(BY_KIND)


def parse(kind: str, payload: Any) -> EventBody:
    """The typed event for a stored kind and payload; raises MalformedEvent (one line) when it is not one."""
    cls = BY_KIND.get(kind)
    if cls is None:
        raise MalformedEvent(f"unknown event kind {kind!r}")
    return cls.from_payload(payload)


@dataclass
class Event:
    """One thing that happened in a run, in order (`seq`) and with wall-clock time: a kind and the payload
    as stored; `body` is the typed event (parsed on first use, so a stored event of a kind this version
    does not know is still loaded, and only fails where it is rendered)."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    run: int | None = None
    round: int | None = None
    seq: int = 0
    time: float = field(default_factory=time.time)

    @classmethod
    def of(cls, body: EventBody, run: int | None = None, round: int | None = None) -> Event:
        """The envelope for a typed event (what the loop emits)."""
        return cls(body.KIND, body.to_payload(), run, round)

    @cached_property
    def body(self) -> EventBody:
        """The typed event; raises MalformedEvent."""
        return parse(self.kind, self.payload)


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
