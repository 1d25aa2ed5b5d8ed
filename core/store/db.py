"""The Store: every run, round, candidate, measurement, decision and event, in one SQLite file.

One writer thread and any number of reader threads (the UI) share a Store; each call opens its own Session,
except inside `transaction()`, where the calling thread's calls share one, so a finished step is committed
whole or not at all. Every string written passes through `redact`, so an API key never reaches the file.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import event as sa_event
from sqlalchemy import func
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import sessionmaker
from sqlmodel import Session, select

from specpilot.core import events as ev
from specpilot.core.memory import ranked
from specpilot.core.store import tables as t
from specpilot.core.store.migrations import SCHEMA_VERSION, upgrade
from specpilot.core.store.redact import redact
from specpilot.core.store.sqlite import StoreError, inspect_file, make_engines, make_read_only_engine

MEMORY_KEYS = ("mechanism", "description", "fragment", "fingerprint", "effect", "evidence")
DECISIONS = ("approve", "reject")
DECIDERS = ("auto", "user")
SPLITS = ("tuning", "heldout")
RUN_STATUSES = ("running", "finished", "stopped", "failed", "interrupted")
RESUMABLE = ("stopped", "interrupted")


def this_process() -> dict:
    """What identifies the process that owns a running run (checked by whoever finds it later)."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def process_gone(process: dict | None) -> bool:
    """True when the process a `running` run names has ended (only decidable on its own host)."""
    if not isinstance(process, dict) or process.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(process["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError, OverflowError):
        return False
    return _zombie(int(process["pid"]))


def _zombie(pid: int) -> bool:
    """A process that exited but was not yet reaped still answers kill(0); its state says it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def interrupted_reason(process: dict | None) -> str:
    pid = process.get("pid") if isinstance(process, dict) else "?"
    return f"its process (pid {pid}) ended without closing the run"


def _scrub_session(session: Session, _context: object, _instances: object) -> None:
    """before_flush hook: redact every column value of every new or changed row."""
    for obj in list(session.new) + list(session.dirty):
        for column in obj.__table__.columns:
            value = getattr(obj, column.key)
            clean = redact(value)
            if clean != value:
                setattr(obj, column.key, clean)


class Store:
    """SQLite-backed persistence for runs; see the module docstring for threading and transactions."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        version = inspect_file(self.path)
        self._sessions = sessionmaker(class_=Session, expire_on_commit=False)
        sa_event.listen(self._sessions, "before_flush", _scrub_session)
        self._local = threading.local()
        if read_only:
            if version is None:
                raise StoreError(f"{self.path} holds no runs yet; run `specpilot run` first or pass --db PATH")
            if version < SCHEMA_VERSION:
                raise StoreError(f"{self.path} has store schema version {version}; open it once with `specpilot "
                                 "run` (which upgrades it) before reading it read-only")
            self._reader = self._writer = make_read_only_engine(self.path)
            return
        self._reader, self._writer = make_engines(self.path)
        try:
            with self._writer.begin() as conn:
                if version is not None and version < SCHEMA_VERSION:
                    self._upgrade(conn, version)
                t.metadata.create_all(conn)
                if version != SCHEMA_VERSION:
                    meta = t.Meta.__table__
                    conn.execute(meta.delete().where(meta.c.key == "schema_version"))
                    conn.execute(meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
        except OperationalError as exc:
            self._reader.dispose()
            raise StoreError(f"{self.path} could not be opened for writing ({exc.orig}); check the file's "
                             "permissions or pass another --db path") from None
        except StoreError:
            self._reader.dispose()
            raise
        self.close_orphans()

    def _upgrade(self, conn: Any, version: int) -> None:
        try:
            upgrade(conn, version)
        except Exception as exc:
            raise StoreError(f"{self.path}: upgrading the store from schema version {version} failed ({exc}); "
                             "the file was left at its old version; pass another --db path") from None

    def close(self) -> None:
        """Release every pooled connection (the last one closing checkpoints the WAL into the file)."""
        self._reader.dispose()

    # --- sessions and transactions --------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group this thread's Store calls into one transaction: all are committed, or none (nesting joins)."""
        if getattr(self._local, "session", None) is not None:
            yield
            return
        with self._sessions(bind=self._writer) as session:
            self._local.session = session
            try:
                yield
                session.commit()
            except IntegrityError as exc:
                session.rollback()
                raise StoreError(f"store write refused ({exc.orig}); this is a bug in the caller") from None
            except BaseException:
                session.rollback()
                raise
            finally:
                self._local.session = None

    @contextmanager
    def _session(self, write: bool = False) -> Iterator[Session]:
        current = getattr(self._local, "session", None)
        if current is not None:
            yield current
            return
        if write:
            with self.transaction():
                yield self._local.session
            return
        with self._sessions(bind=self._reader) as session:
            yield session

    def _row(self, session: Session, model: type, key: int, what: str) -> Any:
        row = session.get(model, key)
        if row is None:
            raise StoreError(f"unknown {what} id {key}; create it first")
        return row

    def _candidate_row(self, session: Session, cid: str) -> t.Candidate:
        row = session.exec(select(t.Candidate).where(t.Candidate.cid == cid)).first()
        if row is None:
            raise StoreError(f"unknown candidate {cid!r}; record it with add_candidate first")
        return row

    def _add(self, session: Session, row: Any) -> int:
        session.add(row)
        session.flush()
        return row.id

    # --- runs and rounds ------------------------------------------------------------------------

    def create_run(self, deployment: dict, config: dict) -> int:
        """Start a run record owned by this process; returns its id (the `run` of its events)."""
        with self._session(write=True) as s:
            return self._add(s, t.Run(deployment=deployment, config={**config, "process": this_process()}))

    def finish_run(self, run_id: int, status: str, summary: dict) -> None:
        """Close a run in one of RUN_STATUSES (a failed or interrupted one says why in summary['reason'])."""
        if status not in RUN_STATUSES:
            raise StoreError(f"unknown run status {status!r}; statuses: {', '.join(RUN_STATUSES)}")
        with self._session(write=True) as s:
            run = self._row(s, t.Run, run_id, "run")
            run.status, run.summary, run.finished_at = status, dict(summary), time.time()
            s.add(run)

    def reopen_run(self, run_id: int) -> None:
        """Take a stopped or interrupted run over (resume): running again, owned by this process, its
        half-done rounds (and their candidates) discarded so only finished rounds remain."""
        with self._session(write=True) as s:
            run = self._row(s, t.Run, run_id, "run")
            status = self._status(run)
            if status not in RESUMABLE:
                raise StoreError(f"run {run_id} is {status}; only a stopped or interrupted run can be resumed")
            for rnd in s.exec(select(t.Round).where(t.Round.run_id == run_id, t.Round.finished_at.is_(None))).all():
                self._delete_round(s, rnd)
            run.status, run.finished_at = "running", None
            run.config = {**run.config, "process": this_process()}
            s.add(run)

    def delete_run(self, run_id: int) -> None:
        """Remove a run that never started a round (refused before it began), events and all."""
        with self._session(write=True) as s:
            run = self._row(s, t.Run, run_id, "run")
            if s.exec(select(t.Round.id).where(t.Round.run_id == run_id)).first() is not None:
                raise StoreError(f"run {run_id} has rounds; it is closed, not deleted")
            for row in s.exec(select(t.Event).where(t.Event.run_id == run_id)).all():
                s.delete(row)
            s.delete(run)

    def _delete_round(self, s: Session, rnd: t.Round) -> None:
        for cand in s.exec(select(t.Candidate).where(t.Candidate.round_id == rnd.id)).all():
            for model in (t.Evaluation, t.ForcingResult, t.Decision):
                for row in s.exec(select(model).where(model.candidate_id == cand.id)).all():
                    s.delete(row)
            s.flush()
            s.delete(cand)
        s.flush()
        s.delete(rnd)
        s.flush()

    @staticmethod
    def _status(run: t.Run) -> str:
        """The run's status, `interrupted` for a `running` one whose process is gone."""
        if run.status == "running" and process_gone((run.config or {}).get("process")):
            return "interrupted"
        return run.status

    def close_orphans(self) -> list[int]:
        """Mark `running` runs whose process is gone as interrupted (the next writer closes them)."""
        closed = []
        with self._session(write=True) as s:
            for run in s.exec(select(t.Run).where(t.Run.status == "running")).all():
                if self._status(run) == "interrupted":
                    run.status, run.finished_at = "interrupted", time.time()
                    run.summary = {**(run.summary or {}), "reason": interrupted_reason(run.config.get("process"))}
                    s.add(run)
                    closed.append(run.id)
        return closed

    def run(self, run_id: int) -> dict | None:
        """One run as a dict (like list_runs' items), or None."""
        return next((r for r in self.list_runs() if r["id"] == run_id), None)

    def list_runs(self) -> list[dict]:
        """Every run, newest first, with its finished-round count and best held-out speedup over AR; a
        `running` run whose process is gone reads as interrupted."""
        with self._session() as s:
            runs = s.exec(select(t.Run).order_by(t.Run.id.desc())).all()
            rounds = s.exec(select(t.Round.run_id, t.Round.incumbent).where(t.Round.finished_at.is_not(None))).all()
        out = []
        for run in runs:
            mine = [inc for rid, inc in rounds if rid == run.id]
            speedups = [inc["heldout_speedup_vs_ar"] for inc in mine
                        if isinstance(inc.get("heldout_speedup_vs_ar"), (int, float))]
            out.append({"id": run.id, "started_at": run.started_at, "finished_at": run.finished_at,
                        "status": self._status(run), "deployment": run.deployment, "config": run.config,
                        "summary": run.summary, "rounds": len(mine),
                        "best_heldout_speedup": max(speedups) if speedups else None})
        return out

    def start_round(self, run_id: int, index: int, gaps: dict) -> int:
        with self._session(write=True) as s:
            self._row(s, t.Run, run_id, "run")
            return self._add(s, t.Round(run_id=run_id, index=index, gaps=gaps))

    def finish_round(self, round_id: int, incumbent: dict) -> None:
        with self._session(write=True) as s:
            rnd = self._row(s, t.Round, round_id, "round")
            rnd.incumbent, rnd.finished_at = dict(incumbent), time.time()
            s.add(rnd)

    def list_rounds(self, run_id: int) -> list[dict]:
        """A run's rounds in index order, each with its candidate count and how many agents proposed nothing
        (their failures are events, not candidates)."""
        with self._session() as s:
            rounds = s.exec(select(t.Round).where(t.Round.run_id == run_id).order_by(t.Round.index)).all()
            counts = dict(s.exec(select(t.Candidate.round_id, func.count()).group_by(t.Candidate.round_id)).all())
            failed = dict(s.exec(select(t.Event.round, func.count()).where(
                t.Event.run_id == run_id, t.Event.kind == "candidate_failed").group_by(t.Event.round)).all())
        return [{**r.model_dump(), "candidates": counts.get(r.id, 0), "failed_proposals": failed.get(r.index, 0)}
                for r in rounds]

    # --- events ---------------------------------------------------------------------------------

    def append_event(self, run_id: int, event: ev.Event) -> ev.Event:
        """Store `event` as the run's next one; returns a copy with run and seq set and secrets redacted."""
        payload = redact(dict(event.payload))
        rnd = event.round if event.round is not None else payload.get("round")
        rnd = rnd if isinstance(rnd, int) and not isinstance(rnd, bool) else None
        with self._session(write=True) as s:
            self._row(s, t.Run, run_id, "run")
            last = s.exec(select(func.max(t.Event.seq)).where(t.Event.run_id == run_id)).one()
            seq = (last or 0) + 1
            s.add(t.Event(run_id=run_id, seq=seq, time=event.time, round=rnd, kind=event.kind, payload=payload))
            s.flush()
        return dataclasses.replace(event, payload=payload, run=run_id, round=rnd, seq=seq)

    def events(self, run_id: int, upto_round: int | None = None) -> list[ev.Event]:
        """A run's events in seq order; with `upto_round`, those up to and including that round's
        round_finished (all of them if that round never finished)."""
        with self._session() as s:
            query = select(t.Event).where(t.Event.run_id == run_id)
            if upto_round is not None:
                end = s.exec(select(func.min(t.Event.seq)).where(
                    t.Event.run_id == run_id, t.Event.kind == "round_finished", t.Event.round == upto_round)).one()
                if end is not None:
                    query = query.where(t.Event.seq <= end)
            rows = s.exec(query.order_by(t.Event.seq)).all()
        return [ev.Event(kind=r.kind, payload=r.payload, run=r.run_id, round=r.round, seq=r.seq, time=r.time)
                for r in rows]

    # --- candidates -----------------------------------------------------------------------------

    def add_candidate(self, round_id: int, cid: str, agent: str, title: str, rationale: str, kind: str,
                      diff: str, recipe_toml: str, predicted_speedup: float | None) -> int:
        with self._session(write=True) as s:
            self._row(s, t.Round, round_id, "round")
            if s.exec(select(t.Candidate.id).where(t.Candidate.cid == cid)).first() is not None:
                raise StoreError(f"candidate {cid!r} already exists; candidate ids must be unique")
            return self._add(s, t.Candidate(round_id=round_id, cid=cid, agent=agent, title=title,
                                            rationale=rationale, kind=kind, diff=diff, recipe_toml=recipe_toml,
                                            predicted_speedup=predicted_speedup))

    def fail_candidate(self, cid: str, reason: str) -> None:
        with self._session(write=True) as s:
            row = self._candidate_row(s, cid)
            row.status, row.reason = "failed", reason
            s.add(row)

    def set_gate(self, cid: str, gate: str, passed: bool, detail: str) -> None:
        """Record a gate's outcome; a failed gate fails the candidate for good."""
        if gate not in ev.GATES:
            raise StoreError(f"unknown gate {gate!r}; gates: {', '.join(ev.GATES)}")
        with self._session(write=True) as s:
            row = self._candidate_row(s, cid)
            row.gates = {**row.gates, gate: {"passed": bool(passed), "detail": detail}}
            if not passed:
                row.status, row.reason = "failed", f"{gate}: {detail}"
            s.add(row)

    def add_forcing(self, cid: str, result: dict) -> int:
        fields = ("tokens", "mismatches", "rate", "near_ties", "threshold", "passed")
        with self._session(write=True) as s:
            row = self._candidate_row(s, cid)
            known = {k: result[k] for k in fields if result.get(k) is not None}
            extra = {k: v for k, v in result.items() if k not in fields}
            return self._add(s, t.ForcingResult(candidate_id=row.id, extra=extra, **known))

    def add_evaluation(self, cid: str, split: str, result: dict) -> int:
        """Store one split's A/B: speedup, low, high, noise_floor, passed and the raw `samples` list."""
        if split not in SPLITS:
            raise StoreError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        fields = ("speedup", "low", "high", "noise_floor", "passed", "samples")
        with self._session(write=True) as s:
            row = self._candidate_row(s, cid)
            known = {k: result[k] for k in fields if result.get(k) is not None}
            extra = {k: v for k, v in result.items() if k not in fields}
            return self._add(s, t.Evaluation(candidate_id=row.id, split=split, extra=extra, **known))

    def add_decision(self, cid: str, decision: str, note: str, by: str) -> int:
        """Record approve/reject; approving a candidate that failed is refused (no override of a gate)."""
        if decision not in DECISIONS or by not in DECIDERS:
            raise StoreError(f"decision must be one of {DECISIONS} by one of {DECIDERS}, got {decision!r} by {by!r}")
        with self._session(write=True) as s:
            row = self._candidate_row(s, cid)
            if decision == "approve" and row.status == "failed":
                raise StoreError(f"candidate {cid!r} failed ({row.reason}); it cannot be approved")
            row.status = "approved" if decision == "approve" else "rejected"
            s.add(row)
            return self._add(s, t.Decision(candidate_id=row.id, decision=decision, note=note, by=by))

    def candidate(self, cid: str) -> dict | None:
        """One candidate with its gates, forcing result, evaluations per split and latest decision."""
        with self._session() as s:
            row = s.exec(select(t.Candidate).where(t.Candidate.cid == cid)).first()
            return None if row is None else self._candidate_dict(s, row)

    def candidates(self, round_id: int) -> list[dict]:
        """A round's candidates in the order they were added."""
        with self._session() as s:
            rows = s.exec(select(t.Candidate).where(t.Candidate.round_id == round_id).order_by(t.Candidate.id)).all()
            return [self._candidate_dict(s, row) for row in rows]

    def _candidate_dict(self, s: Session, row: t.Candidate) -> dict:
        rnd = s.get(t.Round, row.round_id)
        forcing = s.exec(select(t.ForcingResult).where(t.ForcingResult.candidate_id == row.id)
                         .order_by(t.ForcingResult.id.desc())).first()
        evaluations = s.exec(select(t.Evaluation).where(t.Evaluation.candidate_id == row.id)
                             .order_by(t.Evaluation.id)).all()
        decision = s.exec(select(t.Decision).where(t.Decision.candidate_id == row.id)
                          .order_by(t.Decision.id.desc())).first()
        return {**row.model_dump(), "run_id": rnd.run_id if rnd else None, "round": rnd.index if rnd else None,
                "forcing": forcing.model_dump() if forcing else None,
                "evaluations": {e.split: e.model_dump() for e in evaluations},
                "decision": decision.model_dump() if decision else None}

    # --- memory ---------------------------------------------------------------------------------

    def add_memory(self, entry: dict) -> int:
        """Remember a validated mechanism: mechanism, fingerprint (required), description, fragment, effect,
        evidence ({run, round, candidate ids, intervals})."""
        unknown = sorted(set(entry) - set(MEMORY_KEYS))
        missing = [k for k in ("mechanism", "fingerprint") if not entry.get(k)]
        if unknown or missing:
            raise StoreError(f"memory entry: unknown keys {unknown}, missing {missing}; keys: {', '.join(MEMORY_KEYS)}")
        with self._session(write=True) as s:
            return self._add(s, t.MemoryEntry(**{k: v for k, v in entry.items() if v is not None}))

    def memory(self, fingerprint: str | None = None) -> list[dict]:
        """All memory entries: this deployment's first, then others; each group by effect, largest first."""
        with self._session() as s:
            rows = s.exec(select(t.MemoryEntry).order_by(t.MemoryEntry.id)).all()
        return ranked([r.model_dump() for r in rows], fingerprint)
