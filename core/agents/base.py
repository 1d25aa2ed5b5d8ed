"""What every agent gets and gives back: the context of a round in, a candidate (or a reason it failed) out.

Local and Claude agents implement the same `Agent` protocol so the loop can run any mix of them in parallel
and judge their candidates the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from specpilot.core.mechanisms import interfaces_doc
from specpilot.core.recipe import Recipe

CANDIDATE_KINDS = ("recipe", "plugin", "recipe+plugin")


def __getattr__(name: str) -> str:
    """PLUGIN_INTERFACES_DOC: the plugin interface documentation, generated from the mechanism registry each
    time it is read, so a mechanism registered after this import is in it."""
    if name == "PLUGIN_INTERFACES_DOC":
        return interfaces_doc()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class AgentContext:
    """Everything an agent may see for one proposal; the held-out requests are deliberately absent."""

    deployment: dict[str, Any]
    recipe: Recipe
    cost_report: dict[str, Any]
    memory: list[dict[str, Any]]
    direction: str
    workspace: Path
    tuning_summary: dict[str, Any]
    seed: int = 0
    tools: Any = None
    rejected: list[dict[str, Any]] = field(default_factory=list)  # this run's rejections, notes verbatim


@dataclass
class Candidate:
    """A proposed change: the full resulting recipe, the plugin files it needs, and the diff shown to people."""

    agent: str
    title: str
    rationale: str
    kind: str
    diff: str
    recipe: Recipe
    files: dict[str, str] = field(default_factory=dict)
    predicted_speedup: float | None = None
    differs: str = ""  # how it differs from a rejected change it resembles (else it is not judged)

    def __post_init__(self) -> None:
        if self.kind not in CANDIDATE_KINDS:
            raise ValueError(f"candidate kind {self.kind!r} is not one of {', '.join(CANDIDATE_KINDS)}")


@dataclass
class AgentFailure:
    """An agent produced nothing usable; `reason` says why in one line (shown to the user, stored)."""

    agent: str
    reason: str


class Agent(Protocol):
    """Proposes one candidate per call, streaming its text (reasoning, diff) through `on_chunk` in order."""

    name: str

    def propose(self, ctx: AgentContext, on_chunk: Callable[[str], None]) -> Candidate | AgentFailure:
        """Return a Candidate, or an AgentFailure with the reason; never raise for an agent-side problem."""
        ...
