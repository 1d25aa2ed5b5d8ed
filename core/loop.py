"""The search loop: measure -> propose (agents in parallel) -> judge -> decide -> integrate -> remember.

Everything that happens is an Event: stored in SQLite (in order, streamed chunks included) and handed to
whoever watches (the dashboard, or stderr when headless). The loop runs in the caller's thread; agents
run in their own threads; the judge serialises timing per device.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import progress
from core.deployment import Deployment
from core.events import DecisionRefused, Emit, Event
from core.judge import Judge, JudgeRequest
from core.recipe import Recipe
from core.recipe import stock as deployment_stock

STATES = ("preparing", "measuring", "proposing", "judging", "awaiting_approval", "integrating", "paused", "done",
          "stopped", "failed")
PROGRESS_EVERY_S = 1.0  # a long step's progress is stored at most this often (and at its start and end)


@dataclass
class LoopConfig:
    deployment: Deployment = field(default_factory=Deployment)
    rounds: int = 3
    agents: str = "local:4"
    model: str = "claude-opus-5-5"
    auto: bool = False
    db: str = "store.db"
    max_requests: int | None = None
    max_new_tokens: int | None = None
    seed: int = 0
    limit_s: float = 120.0
    workdir: str | None = None  # candidate workspaces; default: .specpilot next to the store
    time_budget_s: float | None = None  # stop before a round that would start after this much wall time
    local_agents: tuple[str, ...] | None = None  # the local agents a run may use, by name (None = all)
    resume: int | None = None  # continue this stopped or interrupted run from its last finished round
    executor: str = "local"  # where the judge's workers run: local | ray (core/executors)
    devices: str | None = None  # the judge's timing slots (--devices), default: the deployment's device
    ray_address: str | None = None  # an existing Ray cluster (--ray-address), default: start a local one


def default_workdir(db: str) -> str:
    """Candidate workspaces live next to the store they belong to (./.specpilot for ./store.db)."""
    return str(Path(db).resolve().parent / ".specpilot")


@dataclass
class Pending:
    cid: str
    recipe: Recipe
    passed: bool
    failed_gate: str | None
    verdict: Any = None
    candidate: Any = None
    decision: str | None = None
    recorded: bool = False  # the decision is stored and its event emitted: the loop may act on it
    note: str = ""


class Loop:
    """The real core behind `specpilot run` and `specpilot-tui` (implements core.events.LoopHandle)."""

    def __init__(self, config: LoopConfig) -> None:
        from core.agents.registry import parse_agents

        self.config = config
        self.counts = dict(parse_agents(config.agents))
        if self.counts.get("claude"):
            from core.agents.claude import require_api_key

            require_api_key()
        from core.store import Store

        from core.executors import make_executor

        self.executor = make_executor(config.executor, config.deployment, config.devices, config.ray_address)
        self.store = Store(config.db)
        self.run_id: int | None = None
        self.round = 0
        self._emit_to: Emit | None = None
        self._events = threading.RLock()  # stored order == emitted order, whichever thread emits
        self._current = "measuring"
        self._lock = threading.Lock()
        self._decided = threading.Condition(self._lock)
        self._pending: dict[str, Pending] = {}
        self._running = threading.Event()
        self._running.set()
        self._stop = False
        self._abort: str | None = None  # why the step in flight is being abandoned (quit, a signal)
        self._step: progress.Step | None = None
        self._last_progress = (None, 0.0)
        self.status: str | None = None  # how the run ended: finished, stopped, failed, interrupted
        self.rejected: list[dict] = []  # this run's rejections (memory entries), given to every agent
        self._finished = 0  # the last finished round's index
        self.judge: Judge | None = None

    # -- control (any thread) -------------------------------------------------------------------------
    def pause(self) -> None:
        """Pause at the next step boundary (the step in flight finishes)."""
        if not self._running.is_set() or self._current in ("done", "failed"):
            return
        self._running.clear()
        self._event("state", {"state": "paused"})

    def resume(self) -> None:
        if self._running.is_set():
            return
        self._event("notice", {"message": "resumed"})
        self._event("state", {"state": self._current})
        self._running.set()

    def stop(self) -> None:
        """End the run at the next step boundary: candidates not yet judged are skipped, the round in flight
        is finished with what was decided, and the run is stored as stopped."""
        with self._decided:
            self._stop = True
            self._decided.notify_all()
        if self.run_id is not None and self._current not in ("done", "failed") and not self._abort:
            self._event("notice", {"message": "stopping at the next step boundary"})
        self._running.set()

    def abort(self, why: str = "quit") -> None:
        """End the run now: the step in flight is abandoned at its next request (its workers killed), the
        round in flight is not counted, and the run is stored as stopped (or interrupted, for a signal)."""
        if self._abort is None:
            self._abort = why
            if self.run_id is not None and self._current not in ("done", "failed"):
                step = self._step.name if self._step is not None else self._current
                self._event("notice", {"message": f"{why}: stopping {step} (workers are killed)"})
        self.stop()

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
            self._event("decision", {"cid": cid, "decision": decision, "note": note, "by": "user"})
        except Exception:
            with self._decided:
                p.decision = None
            raise
        with self._decided:
            p.recorded = True
            self._decided.notify_all()

    # -- events ---------------------------------------------------------------------------------------
    def _event(self, kind: str, payload: dict) -> None:
        if self.run_id is None:
            return
        with self._events:
            stored = self.store.append_event(self.run_id, Event(kind, payload, self.run_id, self.round or None))
            if self._emit_to is not None:
                self._emit_to(stored)

    def _state(self, state: str) -> None:
        self._current, self._step = state, None
        self._event("state", {"state": state})

    def _checkpoint(self) -> None:
        """Between steps: wait while paused; an aborted run goes no further."""
        if not self._running.is_set():
            self._running.wait()
        progress.check()

    def _progress(self, step: progress.Step) -> None:
        """A long step's progress as a `progress` event: at its start, its end, and every PROGRESS_EVERY_S."""
        import time

        self._step = step
        name, last = self._last_progress
        now = time.monotonic()
        if name == step.name and step.done not in (0, step.total) and now - last < PROGRESS_EVERY_S:
            return
        self._last_progress = (step.name, now)
        self._event("progress", {"state": self._current, **step.payload()})

    # -- the run --------------------------------------------------------------------------------------
    def run(self, emit: Emit | None = None) -> dict:
        """Run every round; returns the summary (also stored with the run). The run always ends in a
        recorded status: finished, stopped (quit or stop), interrupted (a signal) or failed (with why)."""
        self._emit_to = emit
        cfg, d = self.config, self.config.deployment
        if cfg.resume is not None:
            self.store.reopen_run(cfg.resume)
            self.run_id = cfg.resume
        else:
            self.run_id = self.store.create_run(d.to_dict(), {k: v for k, v in vars(cfg).items()
                                                              if k not in ("deployment", "resume")})
        try:
            with progress.reporting(self._progress, lambda: self._abort is not None):
                summary = self._run()
        except (progress.Cancelled, KeyboardInterrupt) as exc:
            why = self._abort or "interrupted (SIGINT)"
            self.status = "stopped" if self._abort == "quit" else "interrupted"
            summary = {"run": self.run_id, "reason": f"{why} during {self.waiting_for}, round {self.round or '-'}; "
                                                     "only finished rounds count", "rounds": self._finished}
            self.store.finish_run(self.run_id, self.status, summary)
            self._event("run_finished", {"run": self.run_id, "summary": summary, "status": self.status})
            self._state("stopped")
            if isinstance(exc, KeyboardInterrupt):
                raise
            return summary
        except Exception as exc:
            if self.round == 0 and cfg.resume is None and isinstance(exc, _refusals()):
                self.store.delete_run(self.run_id)  # refused before it began: nothing worth keeping
                self._emit_to = None
                raise
            self._event("error", {"message": f"{type(exc).__name__}: {exc}"})
            self._state("failed")
            self.status = "failed"
            self.store.finish_run(self.run_id, "failed", {"error": str(exc), "reason": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            if self.judge is not None:
                self.judge.close()  # the resident baseline workers
            self.executor.close()
        self.status = "stopped" if self._stop else "finished"
        self.store.finish_run(self.run_id, self.status, summary)
        self._event("run_finished", {"run": self.run_id, "summary": summary, "status": self.status})
        self._state("done")
        return summary

    def _resumed(self) -> tuple[int, dict | None]:
        """(index of the last finished round, its incumbent) of the run being resumed; (0, None) otherwise."""
        if self.config.resume is None:
            return 0, None
        done = [r for r in self.store.list_rounds(self.run_id) if r.get("finished_at") and r.get("incumbent")]
        return (done[-1]["index"], done[-1]["incumbent"]) if done else (0, None)

    def _run(self) -> dict:
        from core.setup import prepare

        cfg, d = self.config, self.config.deployment
        stored = self.store.memory(d.fingerprint())
        memory = [m for m in stored if not is_rejection(m)]
        self.rejected = [m for m in stored if is_rejection(m) and (m.get("evidence") or {}).get("run") == self.run_id]
        here = sum(1 for m in memory if m.get("fingerprint") == d.fingerprint())
        last, resumed = self._resumed()
        self._finished = last
        self._event("run_started", {"run": self.run_id, "deployment": d.to_dict(), "agents": [cfg.agents],
                                    "auto": cfg.auto, "memory": len(memory), "resumed_after_round": last or None})
        if cfg.resume is not None:
            self._event("notice", {"message": f"resuming run {self.run_id} after round {last} of {cfg.rounds}"
                                              + (f", from its incumbent {resumed['recipe'].splitlines()[0]}"
                                                 if resumed else ", from stock")})
        if memory:
            self._event("notice", {"message": f"memory: starting from {len(memory)} validated mechanism(s) "
                                              f"({here} from this deployment)"})
        self.workspace = Path(cfg.workdir or default_workdir(cfg.db)) / f"run-{self.run_id}"
        (self.workspace / "plugins").mkdir(parents=True, exist_ok=True)
        self._state("preparing")
        with progress.step("loading the models and timing AR decoding"):
            ctx = prepare(d, cfg.max_requests, cfg.max_new_tokens, cfg.seed)
        self.ctx = ctx
        stock = deployment_stock(d.drafter is not None)
        self._state("measuring")
        judge = self.judge = Judge(d, ctx.tuning, ctx.heldout, ctx.force, self._call_limit(ctx), cfg.seed,
                                   executor=self.executor)
        with progress.step("calibration"):
            calibration = judge.calibrate(stock, stock, versus_ar=ctx.heldout)
        self._event("notice", {"message": f"noise floor {calibration['noise_floor']:.3f} (A/A on "
                                          f"{len(ctx.tuning)} tuning requests); stock forcing rate "
                                          f"{calibration['stock_forcing']['rate']:.4f}"})
        stock_vs_ar = calibration["incumbent_vs_ar"]
        incumbent, inc_ws = stock, None
        standing = {"vs_ar": stock_vs_ar.speedup, "vs_stock": 1.0, "interval": [stock_vs_ar.low, stock_vs_ar.high]}
        if resumed:
            incumbent = Recipe.from_toml(resumed["recipe"], source=f"run {self.run_id} round {last}")
            inc_ws = Path(resumed["workspace"]) if resumed.get("workspace") else None
            standing = {"vs_ar": resumed["heldout_speedup_vs_ar"], "vs_stock": resumed["heldout_speedup_vs_stock"],
                        "interval": resumed.get("interval")}
        rounds = []
        started = time.monotonic()
        stopped_by = None
        uncovered_seen: set[str] = set()
        stop_reason = None
        for index in range(last + 1, cfg.rounds + 1):
            if self._stop or stop_reason:
                break
            if cfg.time_budget_s is not None and time.monotonic() - started > cfg.time_budget_s:
                stopped_by = f"time budget of {cfg.time_budget_s / 60:.1f} min spent after round {index - 1}"
                self._event("notice", {"message": f"stopping: {stopped_by}"})
                self._stop = True
                break
            self._checkpoint()
            self.round = index
            self._event("round_started", {"round": index})
            self._state("measuring")
            with progress.step("gap analysis"):
                report = ctx.analyse(incumbent)
            ceiling_vs_ar = report["ceiling_tokens_per_s"] / ctx.ar_tokens_per_s if ctx.ar_tokens_per_s else None
            self._event("gaps", {"round": index, "measured_tokens_per_s": report["measured_tokens_per_s"],
                                 "ceiling_tokens_per_s": report["ceiling_tokens_per_s"], "gaps": report["gaps"],
                                 "largest_gap": report["largest_gap"]})
            round_id = self.store.start_round(self.run_id, index, {k: report[k] for k in (
                "measured_tokens_per_s", "ceiling_tokens_per_s", "gaps", "largest_gap")})
            self._checkpoint()
            self._say_uncovered(report, uncovered_seen)
            candidates = self._propose(index, incumbent, inc_ws, report, memory)
            idle = _idle_reason(candidates)
            if idle:
                self._event("notice", {"message": f"round {index}: no candidate: {idle}"})
            self._state("judging")
            pending = self._judge(judge, candidates, incumbent, inc_ws, round_id)
            approved = self._await_decisions(pending)
            self._checkpoint()
            self._state("integrating")
            new, new_ws, evidence = self._integrate(judge, approved, incumbent, inc_ws)
            previous = incumbent
            if new is not incumbent:
                new = new.replace(name=f"run{self.run_id}-round{index}")
                with progress.step("timing the new incumbent against AR and stock"):
                    vs_ar, vs_stock = judge.standing(new, stock, ctx.heldout, new_ws)
                standing = {"vs_ar": vs_ar.speedup, "vs_stock": vs_stock.speedup,
                            "interval": [vs_stock.low, vs_stock.high]}
                incumbent, inc_ws = new, new_ws
            inc = {"round": index, "recipe": incumbent.to_toml(), "heldout_speedup_vs_ar": standing["vs_ar"],
                   "heldout_speedup_vs_stock": standing["vs_stock"], "interval": standing["interval"],
                   "ceiling_speedup_vs_ar": ceiling_vs_ar, "stock_speedup_vs_ar": stock_vs_ar.speedup,
                   "workspace": str(inc_ws) if inc_ws else None}
            progress.check()
            with self._events, self.store.transaction():  # a finished round is stored whole, or not at all
                self._remember(evidence, previous)
                self._remember_rejections(pending, previous)
                self._event("incumbent", inc)
                self._event("round_finished", {"round": index})
                self.store.finish_round(round_id, inc)
            self._finished = index
            rounds.append({"index": index, "largest_gap": report["largest_gap"],
                           "candidates": [self._candidate_summary(p) for p in pending],
                           "incumbent": {"recipe": incumbent.to_toml(), "heldout_speedup_vs_ar": standing["vs_ar"],
                                         "heldout_speedup_vs_stock": standing["vs_stock"],
                                         "interval": standing["interval"]},
                           "gaps": report["gaps"], "predicted_tokens_per_s": report.get("predicted_tokens_per_s"),
                           "measured_tokens_per_s": report["measured_tokens_per_s"], "idle": idle})
            if idle and index < cfg.rounds:
                stop_reason = f"round {index} had no candidate ({idle}); the incumbent is unchanged, so later rounds " \
                              "would propose from the same state"
                self._event("notice", {"message": f"stopping early: {stop_reason}"})
        summary = {"run": self.run_id, "deployment": d.to_dict(), "noise_floor": judge.floor,
                   "stock_heldout_speedup_vs_ar": stock_vs_ar.speedup, "rounds": rounds, "stopped_by": stopped_by}
        if stop_reason:
            summary["stopped_early"] = stop_reason
        return summary

    # -- steps ----------------------------------------------------------------------------------------

    def _call_limit(self, ctx) -> float:
        """A worker's wall-clock limit per request: the configured one, or ten times what our AR takes for
        the longest request (a 1.5B model in float32 decodes 128 tokens in about a minute here)."""
        longest = max((r.max_new_tokens for r in ctx.tuning + ctx.heldout), default=0)
        if not ctx.ar_tokens_per_s:
            return self.config.limit_s
        return max(self.config.limit_s, 10 * longest / ctx.ar_tokens_per_s)

    def _propose(self, index: int, incumbent: Recipe, inc_ws: Path | None, report: dict,
                 memory: list[dict]) -> list[tuple[str, Any]]:
        from core.agents.registry import directions, make_agents

        self._state("proposing")
        agents = make_agents(self.config.agents, self.config.seed + index, self.config.model, report=report,
                             memory=memory, incumbent=incumbent, only=self.config.local_agents)
        results = self._run_agents(index, agents, directions(report, len(agents)), 0, incumbent, inc_ws, report,
                                   memory)
        if _idle_reason(results):  # nothing for the largest gaps: the agents not yet tried, on the next gaps
            tried = tuple(a.name for a in agents)
            more = make_agents(self.config.agents, self.config.seed + index, self.config.model, report=report,
                               memory=memory, incumbent=incumbent, only=self.config.local_agents, skip=tried)
            if more:
                self._event("notice", {"message": f"no candidate for the largest gaps; trying "
                                                  f"{', '.join(a.name for a in more)} on the next ones"})
                dirs = directions(report, len(agents) + len(more))[len(agents):]
                results += self._run_agents(index, more, dirs, len(agents), incumbent, inc_ws, report, memory)
        return results

    def _say_uncovered(self, report: dict, seen: set[str]) -> None:
        """Once per run, one line for each gap component that no agent of this run can act on."""
        from core.agents.registry import uncovered

        for component in uncovered(report, self.counts, self.config.local_agents):
            if component not in seen:
                seen.add(component)
                ms = next((g.get("ms_per_token", 0.0) for g in report.get("gaps", [])
                           if g.get("component") == component), 0.0)
                self._event("notice", {"message": f"no agent of this run acts on the {component} gap "
                                                  f"({ms:.2f} ms/token)"})

    def _run_agents(self, index: int, agents: list, dirs: list[str], offset: int, incumbent: Recipe,
                    inc_ws: Path | None, report: dict, memory: list[dict]) -> list[tuple[str, Any]]:
        """Run `agents` in parallel threads; candidate ids continue after `offset`."""
        from core.agents.base import AgentContext, AgentFailure

        results: list[tuple[str, Any]] = [None] * len(agents)

        def work(i: int) -> None:
            agent = agents[i]
            cid = f"{self.run_id}-r{index}-c{offset + i + 1}"  # unique across the store: runs share it
            ws = self._candidate_workspace(cid, inc_ws)
            self._event("agent_started", {"cid": cid, "agent": agent.name, "direction": dirs[i]})
            context = AgentContext(deployment=self.config.deployment.to_dict(), recipe=incumbent, cost_report=report,
                                   memory=memory, direction=dirs[i], workspace=ws,
                                   tuning_summary=self.ctx.tuning_summary, seed=self.config.seed + index,
                                   tools=self.ctx.tools, rejected=list(self.rejected))
            try:
                out = agent.propose(context, lambda text: self._event("agent_chunk", {"cid": cid, "text": text}))
            except Exception as exc:  # an agent bug is that candidate's failure, never the loop's
                out = AgentFailure(agent.name, f"agent crashed: {type(exc).__name__}: {exc}")
            results[i] = (cid, self._unless_rejected(out, incumbent))
            if not isinstance(results[i][1], AgentFailure):
                self._event("agent_done", {"cid": cid, "agent": agent.name, "title": out.title})

        with ThreadPoolExecutor(max_workers=max(1, len(agents))) as pool:
            list(pool.map(work, range(len(agents))))
        return results

    def _judge(self, judge: Judge, candidates: list[tuple[str, Any]], incumbent: Recipe, inc_ws, round_id: int) -> list[Pending]:
        """Judge the candidates, as many at once as the judge has devices; results in candidate order."""
        one = progress.carried(lambda item: self._judge_one(judge, item[0], item[1], incumbent, inc_ws, round_id))
        if judge.parallel == 1:
            judged = [one(c) for c in candidates]
        else:
            with ThreadPoolExecutor(max_workers=judge.parallel) as pool:
                judged = list(pool.map(one, candidates))
        return [p for p in judged if p is not None]

    def _judge_one(self, judge: Judge, cid: str, out: Any, incumbent: Recipe, inc_ws, round_id: int) -> Pending | None:
        from core.agents.base import AgentFailure
        from core.agents.diffs import DiffError

        self._checkpoint()
        if self._stop:
            self._event("notice", {"message": f"{cid} not judged: the run is stopping"})
            return None
        if isinstance(out, AgentFailure):
            self._event("candidate_failed", {"cid": cid, "agent": out.agent, "reason": out.reason})
            return None
        ws = self.workspace / cid
        try:
            files = _checked_files(out.files)
        except DiffError as exc:  # the applies gate: nothing outside the allow-list is ever written
            self._event("candidate_failed", {"cid": cid, "agent": out.agent,
                                             "reason": f"diff did not apply: {exc}"})
            return None
        for rel, text in files.items():
            path = ws / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        self.store.add_candidate(round_id, cid, out.agent, out.title, out.rationale, out.kind, out.diff,
                                 out.recipe.to_toml(), out.predicted_speedup)
        self._event("candidate", {"cid": cid, "agent": out.agent, "title": out.title, "rationale": out.rationale,
                                  "kind": out.kind, "diff": out.diff, "recipe": out.recipe.to_toml(),
                                  "predicted_speedup": out.predicted_speedup})

        def on_gate(gate: str, passed: bool, detail: str, cid: str = cid) -> None:
            self.store.set_gate(cid, gate, passed, detail)
            self._event("gate", {"cid": cid, "gate": gate, "passed": passed, "detail": detail})

        def on_forcing(result: dict, cid: str = cid) -> None:
            self.store.add_forcing(cid, result)
            keys = ("tokens", "mismatches", "rate", "near_ties", "threshold", "passed")
            self._event("forcing", {"cid": cid, **{k: result.get(k) for k in keys}})

        def on_evaluation(split: str, result, cid: str = cid) -> None:
            self._event("evaluation", {"cid": cid, "split": split, "speedup": result.speedup, "low": result.low,
                                       "high": result.high, "passed": result.passed})

        with progress.step(f"judging {cid}"):
            verdict = judge.evaluate(out.recipe, incumbent, ws, inc_ws, on_gate, on_forcing, on_evaluation,
                                     diff=out.diff)
        for split, samples in verdict.samples.items():
            comp = getattr(verdict, split)  # None when the split's outputs failed forcing: no speedup
            self.store.add_evaluation(cid, split, {**(comp.to_dict() if comp else {"passed": False}),
                                                   "samples": samples})
        failed = next((g for g, r in verdict.gates.items() if not r["passed"]), None)
        return Pending(cid, out.recipe, verdict.passed, failed, verdict, out)

    def _await_decisions(self, pending: list[Pending]) -> list[Pending]:
        waiting = [p for p in pending if p.passed]
        if not waiting:
            return []
        if self.config.auto:
            for p in waiting:
                p.decision = "approve"
                self.store.add_decision(p.cid, "approve", "passed every gate", "auto")
                self._event("decision", {"cid": p.cid, "decision": "approve", "note": "passed every gate", "by": "auto"})
            return waiting
        with self._decided:
            for p in pending:
                self._pending[p.cid] = p
        self._state("awaiting_approval")
        for p in waiting:
            self._event("awaiting_decision", {"cid": p.cid})
        with self._decided:
            while not self._stop and any(not p.recorded for p in waiting):
                self._decided.wait(timeout=0.5)
            for p in pending:
                self._pending.pop(p.cid, None)
            return [p for p in waiting if p.recorded and p.decision == "approve"]

    def _integrate(self, judge: Judge, approved: list[Pending], incumbent: Recipe, inc_ws):
        """One winner becomes the incumbent; several are combined and re-judged together."""
        if not approved:
            return incumbent, inc_ws, []
        best = max(approved, key=lambda p: p.verdict.heldout.speedup)
        choice, ws, evidence = best.recipe, self.workspace / best.cid, [best]
        if len(approved) > 1:
            combined = _combine(incumbent, [p.recipe for p in sorted(approved, key=lambda p: -p.verdict.heldout.speedup)])
            if combined is not None and combined != best.recipe:
                cid = f"{self.run_id}-r{self.round}-merge"
                self._event("notice", {"message": f"integrating {len(approved)} winners into one recipe; re-judging"})
                merged_ws = self.workspace / cid
                (merged_ws / "plugins").mkdir(parents=True, exist_ok=True)
                for p in approved:
                    for f in (self.workspace / p.cid / "plugins").glob("*.py"):
                        (merged_ws / "plugins" / f.name).write_text(f.read_text())
                with progress.step("judging the combined winners"):
                    verdict = judge.evaluate(combined, best.recipe, merged_ws, ws)
                if verdict.passed:
                    self._event("notice", {"message": f"combined recipe beats the best single winner "
                                                      f"({verdict.heldout.speedup:.3f}x held-out)"})
                    return combined, merged_ws, approved
                self._event("notice", {"message": f"combined recipe kept out ({verdict.reason}); "
                                                  f"taking {best.cid}"})
        return choice, ws, evidence

    def _unless_rejected(self, out: Any, incumbent: Recipe) -> Any:
        """A candidate that repeats a rejected change, without saying what differs, fails here: the person
        said no, whatever an agent (local or Claude) makes of the note."""
        from core.agents.base import AgentFailure, Candidate, rejection_line, rejection_of

        if not isinstance(out, Candidate) or out.differs.strip():
            return out
        hit = rejection_of(out.recipe, incumbent, self.rejected)
        if hit is None:
            return out
        return AgentFailure(out.agent, f"proposed {out.title!r} again, which repeats {rejection_line(hit)}; "
                                       "a repeat must say what differs")

    def _remember_rejections(self, pending: list[Pending], previous: Recipe) -> None:
        """Store each rejected candidate in memory (marked as a rejection, with the note verbatim) so the
        run's later rounds, and a resumed run, do not propose it again."""
        for p in pending:
            if p.decision != "reject" or not p.recorded:
                continue
            entry = {"mechanism": p.candidate.title, "description": p.note or p.candidate.rationale,
                     "fragment": _fragment(p.recipe, previous.to_dict()), "fingerprint": self.config.deployment.fingerprint(),
                     "effect": None,
                     "evidence": {"decision": "reject", "note": p.note, "run": self.run_id, "round": self.round,
                                  "cid": p.cid}}
            self.store.add_memory(entry)
            self.rejected.append(entry)

    def _candidate_workspace(self, cid: str, inc_ws: Path | None) -> Path:
        """A candidate's workspace starts with the incumbent's plugins, so agents see (and recipes keep
        using) the code the incumbent runs; one left by an abandoned attempt at this round is cleared."""
        import shutil

        ws = self.workspace / cid
        if ws.exists():
            shutil.rmtree(ws)
        (ws / "plugins").mkdir(parents=True, exist_ok=True)
        if inc_ws is not None:
            for f in (Path(inc_ws) / "plugins").glob("*.py"):
                (ws / "plugins" / f.name).write_text(f.read_text())
        return ws

    def _remember(self, evidence: list[Pending], previous: Recipe) -> None:
        """Store each winner's mechanism as the fields it changed relative to the incumbent it was made
        against, with its held-out evidence."""
        d = self.config.deployment
        for p in evidence:
            fragment = _fragment(p.recipe, previous.to_dict())
            comp = p.verdict.heldout
            plugins = _plugin_sources(p.recipe, self.workspace / p.cid)
            self.store.add_memory({
                "mechanism": p.candidate.title, "description": p.candidate.rationale, "fragment": fragment,
                "fingerprint": d.fingerprint(),
                "effect": comp.speedup,
                "evidence": {"run": self.run_id, "round": self.round, "cid": p.cid, "interval": [comp.low, comp.high],
                             "tuning": p.verdict.tuning.to_dict(), "heldout": comp.to_dict(),
                             **({"plugins": plugins} if plugins else {})},
            })

    @staticmethod
    def _candidate_summary(p: Pending) -> dict:
        v = p.verdict
        held = v.heldout
        return {"cid": p.cid, "agent": p.candidate.agent, "title": p.candidate.title,
                "gates": {g: r["passed"] for g, r in v.gates.items()},
                "verdict": "win" if p.passed else "fail", "reason": v.reason, "decision": p.decision,
                "predicted_speedup": p.candidate.predicted_speedup,
                "heldout_speedup": held.speedup if held else None,
                "interval": [held.low, held.high] if held else None,
                "forcing_rate": v.forcing["rate"] if v.forcing else None}


def _idle_reason(results: list[tuple[str, Any]]) -> str | None:
    """None when some agent proposed a candidate; else why none did, one agent per clause."""
    from core.agents.base import AgentFailure

    if not results or any(not isinstance(out, AgentFailure) for _, out in results):
        return None if results else "no agent ran"
    return "; ".join(f"{out.agent}: {out.reason}" for _, out in results)


def _plugin_sources(recipe: Recipe, workspace: Path) -> dict[str, str]:
    """The workspace plugin files that register a plugin the recipe names (path -> source), so memory can
    re-propose the mechanism in a later run; read as text, never imported."""
    from core.mechanisms import PLUGIN_PREFIX, declared_in, recipe_mechanisms

    wanted = {(k, v.removeprefix(PLUGIN_PREFIX)) for k, v in recipe_mechanisms(recipe) if v.startswith(PLUGIN_PREFIX)}
    return {f"plugins/{path.name}": path.read_text() for path in sorted((workspace / "plugins").glob("*.py"))
            if wanted & declared_in(path)}


def is_rejection(entry: dict) -> bool:
    """A memory entry that records a person's rejection, not a validated win."""
    return (entry.get("evidence") or {}).get("decision") == "reject"


def _refusals() -> tuple[type[BaseException], ...]:
    """Errors that mean the run could not begin (bad paths, files, options): no run is kept for them."""
    from core.engine import ModelLoadError
    from core.recipe import RecipeError
    from core.workload import WorkloadError

    return (ModelLoadError, WorkloadError, RecipeError, FileNotFoundError, ValueError)


def _combine(incumbent: Recipe, winners: list[Recipe]) -> Recipe | None:
    """Apply each winner's changed fields (relative to the incumbent) on top of each other, best first."""
    base = incumbent.to_dict()
    merged = json.loads(json.dumps(base))
    for w in winners:
        for section, fields in w.to_dict().items():
            if not isinstance(fields, dict):
                continue
            for key, value in fields.items():
                if base[section][key] != value and merged[section][key] == base[section][key]:
                    merged[section][key] = value
    try:
        return Recipe.from_dict({**merged, "name": "combined"})
    except ValueError:
        return None


def _checked_files(files: dict | None) -> dict[str, str]:
    """A candidate's plugin files, each path checked against the allow-list (plugins/<name>.py inside the
    workspace); raises DiffError naming the first path refused."""
    from pathlib import PurePosixPath

    from core.agents.base import PLUGIN_GLOB
    from core.agents.diffs import AllowList, DiffError

    allow = AllowList((PLUGIN_GLOB,))
    out: dict[str, str] = {}
    for rel, text in (files or {}).items():
        pure = PurePosixPath(str(rel))
        clean = str(PurePosixPath(*[p for p in pure.parts if p != "."])) if pure.parts else ""
        if pure.is_absolute() or ".." in pure.parts or "\\" in str(rel) or not allow(clean):
            raise DiffError(f"path {rel} is outside the allow-list: {allow.description}")
        if not isinstance(text, str):
            raise DiffError(f"{rel}: file content must be text")
        out[clean] = text
    return out


def _fragment(recipe: Recipe, base: dict) -> dict:
    """The sections and fields a recipe changed relative to `base` (all of it when base is unknown)."""
    out: dict[str, dict] = {}
    for section, fields in recipe.to_dict().items():
        if not isinstance(fields, dict):
            continue
        changed = {k: v for k, v in fields.items() if base.get(section, {}).get(k) != v}
        if changed:
            out[section] = changed
    return out


def config_from_args(args: argparse.Namespace) -> LoopConfig:
    import os

    db = args.db or os.environ.get("SPECPILOT_DB") or "store.db"
    if getattr(args, "resume", None) is not None:
        return _resumed_config(args.resume, db, bool(args.auto))
    return LoopConfig(deployment=Deployment.from_args(args), rounds=args.rounds, agents=args.agents,
                      model=getattr(args, "model", None) or "claude-opus-5-5", auto=args.auto, db=db,
                      max_requests=getattr(args, "max_requests", None),
                      max_new_tokens=getattr(args, "max_new_tokens", None), seed=getattr(args, "seed", 0) or 0,
                      time_budget_s=60 * args.time_budget if getattr(args, "time_budget", None) else None,
                      workdir=os.environ.get("SPECPILOT_WORKDIR") or default_workdir(db),
                      local_agents=parse_local_agents(getattr(args, "local_agents", None)),
                      executor=getattr(args, "executor", None) or "local", devices=getattr(args, "devices", None),
                      ray_address=getattr(args, "ray_address", None))


def parse_local_agents(spec: str | None) -> tuple[str, ...] | None:
    """--local-agents: None (all), 'knobs' (the agents that only set recipe fields), or a comma list of names;
    an unknown name is a ValueError listing the known ones."""
    from core.agents.local import DEFAULT_ORDER, KNOB_AGENTS, MemoryAgent

    if spec is None:
        return None
    if spec.strip() == "knobs":
        return KNOB_AGENTS
    known = [c.default_name for c in (*DEFAULT_ORDER, MemoryAgent)]
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--local-agents: unknown agent {bad[0] if bad else spec!r}; known: {', '.join(known)}, "
                         "or 'knobs'")
    return names


def _resumed_config(run_id: int, db: str, auto: bool) -> LoopConfig:
    """The stored run's own deployment and options, to continue it where its last finished round ended."""
    import dataclasses

    from core.store import Store
    from core.store.db import RESUMABLE

    if not Path(db).is_file():
        raise FileNotFoundError(f"no store at {db}; pass the --db the run was stored in")
    store = Store(db, read_only=True)
    try:
        run = store.run(run_id)
    finally:
        store.close()
    if run is None:
        raise FileNotFoundError(f"run {run_id} is not in {db}; see `specpilot runs`")
    if run["status"] not in RESUMABLE:
        raise ValueError(f"run {run_id} is {run['status']}; only a stopped or interrupted run can be resumed")
    names = {f.name for f in dataclasses.fields(Deployment)}
    deployment = Deployment(**{k: v for k, v in run["deployment"].items() if k in names})
    known = {f.name for f in dataclasses.fields(LoopConfig)} - {"deployment", "db", "resume", "auto"}
    stored = {k: v for k, v in run["config"].items() if k in known}
    return LoopConfig(deployment=deployment, db=db, resume=run_id, auto=auto or bool(run["config"].get("auto")),
                      **stored)


def build_loop(args: argparse.Namespace) -> Loop:
    """What the dashboard and `specpilot run` call."""
    return Loop(config_from_args(args))


def stderr_progress(event: Event) -> None:
    """Headless progress: one line per meaningful event on stderr."""
    p = event.payload
    line = None
    if event.kind == "round_started":
        line = f"round {p['round']}"
    elif event.kind == "gaps":
        line = (f"  measured {p['measured_tokens_per_s']:.0f} tok/s, ceiling {p['ceiling_tokens_per_s']:.0f}; "
                f"largest gap: {p['largest_gap']}")
    elif event.kind == "candidate":
        line = f"  {p['cid']} {p['agent']}: {p['title']}"
    elif event.kind == "candidate_failed":
        line = f"  {p['cid']} {p['agent']}: no candidate ({p['reason']})"
    elif event.kind == "gate" and not p["passed"]:
        line = f"    {p['cid']} failed {p['gate']}: {p['detail']}"
    elif event.kind == "evaluation":
        line = f"    {p['cid']} {p['split']}: {p['speedup']:.3f}x [{p['low']:.3f}, {p['high']:.3f}] vs the incumbent"
    elif event.kind == "incumbent":
        line = (f"  incumbent: {p['heldout_speedup_vs_ar']:.2f}x vs AR, {p['heldout_speedup_vs_stock']:.2f}x "
                f"vs stock (held-out)")
    elif event.kind == "notice":
        line = f"  {event.kind}: {p['message']}"
    elif event.kind == "progress" and _progress_worth_a_line(p):
        line = f"  {progress.describe(p)}"
    elif event.kind == "run_finished":
        line = f"run {p['run']} {p.get('status', 'finished')}" + (f": {p['summary']['reason']}"
                                                                 if (p.get("summary") or {}).get("reason") else "")
    if line:
        print(line, file=sys.stderr, flush=True)


_printed: dict[str, int] = {}


def _progress_worth_a_line(p: dict) -> bool:
    """Headless output keeps a long step to a few lines: its start, each quarter, its end."""
    total, done = p.get("total"), p.get("done") or 0
    if not total:
        return False
    quarter = 4 * done // total
    if _printed.get(p.get("step", "")) == quarter:
        return False
    _printed[p.get("step", "")] = quarter
    return True
