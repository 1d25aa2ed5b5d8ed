"""SQLModel tables of store.db (schema version 1).

JSON columns hold the structured parts (deployments, gaps, raw samples, event payloads). SQLAlchemy does not
see in-place mutation of a JSON value, so code that changes one assigns a new object.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Optional

from sqlalchemy import JSON, Column, Index, MetaData, UniqueConstraint
from sqlmodel import Field, SQLModel


class StoreModel(SQLModel):
    """Base of the store's tables, with its own MetaData so no other SQLModel table lands in store.db."""

    metadata: ClassVar[MetaData] = MetaData()


metadata = StoreModel.metadata


def _json(default: Any = dict) -> Any:
    return Field(default_factory=default, sa_column=Column(JSON, nullable=False))


class Meta(StoreModel, table=True):
    """Key/value facts about the file itself; `schema_version` says how to read it."""

    __tablename__ = "meta"
    key: str = Field(primary_key=True)
    value: str


class Run(StoreModel, table=True):
    __tablename__ = "run"
    id: Optional[int] = Field(default=None, primary_key=True)
    started_at: float = Field(default_factory=time.time)
    finished_at: Optional[float] = None
    status: str = "running"
    deployment: dict = _json()
    config: dict = _json()
    summary: dict = _json()


class Round(StoreModel, table=True):
    __tablename__ = "round"
    __table_args__ = (UniqueConstraint("run_id", "index"),)
    id: Optional[int] = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    index: int
    started_at: float = Field(default_factory=time.time)
    finished_at: Optional[float] = None
    gaps: dict = _json()
    incumbent: dict = _json()


class Candidate(StoreModel, table=True):
    """A proposal; `status` is proposed|failed|approved|rejected, `gates` maps gate -> {passed, detail}."""

    __tablename__ = "candidate"
    id: Optional[int] = Field(default=None, primary_key=True)
    round_id: int = Field(foreign_key="round.id", index=True)
    cid: str = Field(unique=True, index=True)
    agent: str
    title: str = ""
    rationale: str = ""
    kind: str = "recipe"
    diff: str = ""
    recipe_toml: str = ""
    predicted_speedup: Optional[float] = None
    status: str = "proposed"
    reason: str = ""
    gates: dict = _json()
    created_at: float = Field(default_factory=time.time)


class Evaluation(StoreModel, table=True):
    """One timed A/B of a candidate on one split, with every raw per-request sample kept."""

    __tablename__ = "evaluation"
    id: Optional[int] = Field(default=None, primary_key=True)
    candidate_id: int = Field(foreign_key="candidate.id", index=True)
    split: str
    speedup: Optional[float] = None
    low: Optional[float] = None
    high: Optional[float] = None
    noise_floor: Optional[float] = None
    passed: bool = False
    samples: list = _json(list)
    extra: dict = _json()
    created_at: float = Field(default_factory=time.time)


class ForcingResult(StoreModel, table=True):
    __tablename__ = "forcing_result"
    id: Optional[int] = Field(default=None, primary_key=True)
    candidate_id: int = Field(foreign_key="candidate.id", index=True)
    tokens: int = 0
    mismatches: int = 0
    rate: float = 0.0
    near_ties: int = 0
    threshold: float = 0.0
    passed: bool = False
    extra: dict = _json()
    created_at: float = Field(default_factory=time.time)


class Decision(StoreModel, table=True):
    __tablename__ = "decision"
    id: Optional[int] = Field(default=None, primary_key=True)
    candidate_id: int = Field(foreign_key="candidate.id", index=True)
    decision: str
    note: str = ""
    by: str = "user"
    time: float = Field(default_factory=time.time)


class MemoryEntry(StoreModel, table=True):
    """A mechanism that won on held-out requests, with the deployment it won on and the evidence."""

    __tablename__ = "memory_entry"
    id: Optional[int] = Field(default=None, primary_key=True)
    mechanism: str = Field(index=True)
    description: str = ""
    fragment: Any = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    fingerprint: str = Field(index=True)
    effect: Optional[float] = None
    evidence: dict = _json()
    created_at: float = Field(default_factory=time.time)


class Event(StoreModel, table=True):
    """The replay log: every event of a run in `seq` order, streamed chunks included."""

    __tablename__ = "event"
    __table_args__ = (UniqueConstraint("run_id", "seq"), Index("ix_event_run_round", "run_id", "round"))
    id: Optional[int] = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id")
    seq: int
    time: float
    round: Optional[int] = None
    kind: str
    payload: dict = _json()


TABLES = ("meta", "run", "round", "candidate", "evaluation", "forcing_result", "decision", "memory_entry", "event")
