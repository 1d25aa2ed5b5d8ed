"""The rounds: measure -> propose (agents in parallel) -> judge -> decide -> integrate -> remember.

The loop runs in the caller's thread; agents run in their own threads; the judge serialises timing per
device. Control from other threads (core/loop/control.py), event persistence (core/loop/record.py), the
workspace files (core/loop/workspace.py) and memory (core/memory.py) live in their own modules.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from core import memory as mem
from core import progress
from core.events import (AgentChunk, AgentDone, AgentStarted, CandidateFailed, CandidateProposed, Emit, Error,
                         Evaluated, Forced, GateChecked, Gaps, NewIncumbent, Notice, RoundFinished, RoundStarted,
                         RunFinished, RunStarted)
from core.judge import Forcing, Judge
from core.loop.config import LoopConfig, default_workdir
from core.loop.control import Control, Pending
from core.loop.workspace import Workspace
from core.recipe import Recipe, combine
from core.recipe import stock as deployment_stock


class Loop(Control):
    """The real core behind `specpilot run` and `specpilot-tui` (implements core.events.LoopHandle)."""

    def __init__(self, config: LoopConfig) -> None:
        from core.agents.registry import parse_agents

        self.config = config
        self.counts = dict(parse_agents(config.agents))
        if self.counts.get("claude"):
            from core.agents.claude import require_api_key

            require_api_key()
        from core.executors import make_executor
        from core.store import Store

        self.executor = make_executor(config.executor, config.deployment, config.devices, config.ray_address)
        super().__init__(Store(config.db))
        self.status: str | None = None  # how the run ended: finished, stopped, failed, interrupted
        self.rejected: list[dict] = []  # this run's rejections (memory entries), given to every agent
        self._finished = 0  # the last finished round's index
        self.judge: Judge | None = None

    # -- the run --------------------------------------------------------------------------------------
    def run(self, emit: Emit | None = None) -> dict:
        """Run every round; returns the summary (also stored with the run). The run always ends in a
        recorded status: finished, stopped (quit or stop), interrupted (a signal) or failed (with why)."""
        self.log.emit_to = emit
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
            summary = self._close_abandoned(self._abort or "interrupted (SIGINT)")
            self.log(RunFinished(self.run_id, summary, self.status))
            self._state("stopped")
            if isinstance(exc, KeyboardInterrupt):
                raise
            return summary
        except Exception as exc:
            if self.round == 0 and cfg.resume is None and isinstance(exc, _refusals()):
                self.store.delete_run(self.run_id)  # refused before it began: nothing worth keeping
                self.log.emit_to = None
                raise
            self.log(Error(f"{type(exc).__name__}: {exc}"))
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
        self.log(RunFinished(self.run_id, summary, self.status))
        self._state("done")
        return summary

    def _close_abandoned(self, why: str, left: str = "") -> dict:
        """Store the run as ended by `why` in the step in flight: stopped for a quit, else interrupted."""
        self.status = "stopped" if why == "quit" else "interrupted"
        summary = {"run": self.run_id, "reason": f"{why} during {self.waiting_for}, round {self.round or '-'}{left}; "
                                                 "only finished rounds count", "rounds": self._finished}
        self.store.finish_run(self.run_id, self.status, summary)
        return summary

    def close_abandoned(self) -> None:
        """The process is leaving before the abandoned step ended (`q` twice, or the grace ran out): record
        the run as the loop would have once the step ended, so a quit reads as stopped, not interrupted."""
        if self.run_id is not None and self.status is None:
            self._close_abandoned(self._abort or "quit", ", left before it ended")

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
        memory, self.rejected = mem.split(stored, self.run_id)
        here = sum(1 for m in memory if m.get("fingerprint") == d.fingerprint())
        last, resumed = self._resumed()
        self._finished = last
        self.log(RunStarted(self.run_id, d.to_dict(), [cfg.agents], cfg.auto, memory=len(memory),
                            resumed_after_round=last or None))
        if cfg.resume is not None:
            self.log(Notice(f"resuming run {self.run_id} after round {last} of {cfg.rounds}"
                            + (f", from its incumbent {resumed['recipe'].splitlines()[0]}"
                            if resumed else ", from stock")))
        if memory:
            self.log(Notice(f"memory: starting from {len(memory)} validated mechanism(s) "
                            f"({here} from this deployment)"))
        self.workspace = Workspace(Path(cfg.workdir or default_workdir(cfg.db)) / f"run-{self.run_id}")
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
        self.log(Notice(f"noise floor {calibration['noise_floor']:.3f} (A/A, {len(calibration['aa_samples'])} "
                        f"paired timings of {len(ctx.tuning)} tuning requests: bias {calibration['aa_bias']:+.3f}, "
                        f"spread {calibration['aa_spread']:.3f}); stock forcing rate "
                        f"{calibration['stock_forcing']['rate']:.4f}"))
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
                self.log(Notice(f"stopping: {stopped_by}"))
                self._stop = True
                break
            self._checkpoint()
            self.round = index
            self.log(RoundStarted(index))
            self._state("measuring")
            with progress.step("gap analysis"):
                report = ctx.analyse(incumbent)
            ceiling_vs_ar = report["ceiling_tokens_per_s"] / ctx.ar_tokens_per_s if ctx.ar_tokens_per_s else None
            self.log(Gaps(index, measured_tokens_per_s=report["measured_tokens_per_s"],
                          ceiling_tokens_per_s=report["ceiling_tokens_per_s"], gaps=report["gaps"],
                          largest_gap=report["largest_gap"]))
            round_id = self.store.start_round(self.run_id, index, {k: report[k] for k in (
                "measured_tokens_per_s", "ceiling_tokens_per_s", "gaps", "largest_gap")})
            self._checkpoint()
            self._say_uncovered(report, uncovered_seen)
            candidates = self._propose(index, incumbent, inc_ws, report, memory)
            idle = _idle_reason(candidates)
            if idle:
                self.log(Notice(f"round {index}: no candidate: {idle}"))
            self._state("judging")
            pending = self._judge(judge, candidates, incumbent, inc_ws, round_id)
            approved = self.await_decisions(pending, cfg.auto)
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
            inc = NewIncumbent(heldout_speedup_vs_ar=standing["vs_ar"], round=index, recipe=incumbent.to_toml(),
                               heldout_speedup_vs_stock=standing["vs_stock"], interval=standing["interval"],
                               ceiling_speedup_vs_ar=ceiling_vs_ar, stock_speedup_vs_ar=stock_vs_ar.speedup,
                               workspace=str(inc_ws) if inc_ws else None)
            progress.check()
            with self.log.lock, self.store.transaction():  # a finished round is stored whole, or not at all
                self._remember(evidence, previous)
                self._remember_rejections(pending, previous)
                self.log(inc)
                self.log(RoundFinished(index))
                self.store.finish_round(round_id, inc.to_payload())
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
                self.log(Notice(f"stopping early: {stop_reason}"))
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
                self.log(Notice(f"no candidate for the largest gaps; trying "
                                f"{', '.join(a.name for a in more)} on the next ones"))
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
                self.log(Notice(f"no agent of this run acts on the {component} gap "
                                f"({ms:.2f} ms/token)"))

    def _run_agents(self, index: int, agents: list, dirs: list[str], offset: int, incumbent: Recipe,
                    inc_ws: Path | None, report: dict, memory: list[dict]) -> list[tuple[str, Any]]:
        """Run `agents` in parallel threads; candidate ids continue after `offset`."""
        from core.agents.base import AgentContext, AgentFailure

        results: list[tuple[str, Any]] = [None] * len(agents)

        def work(i: int) -> None:
            agent = agents[i]
            cid = f"{self.run_id}-r{index}-c{offset + i + 1}"  # unique across the store: runs share it
            ws = self.workspace.for_candidate(cid, inc_ws)
            self.log(AgentStarted(cid, agent.name, dirs[i]))
            context = AgentContext(deployment=self.config.deployment.to_dict(), recipe=incumbent, cost_report=report,
                                   memory=memory, direction=dirs[i], workspace=ws,
                                   tuning_summary=self.ctx.tuning_summary, seed=self.config.seed + index,
                                   tools=self.ctx.tools, rejected=list(self.rejected))
            try:
                out = agent.propose(context, lambda text: self.log(AgentChunk(cid, text)))
            except Exception as exc:  # an agent bug is that candidate's failure, never the loop's
                out = AgentFailure(agent.name, f"agent crashed: {type(exc).__name__}: {exc}")
            results[i] = (cid, self._unless_rejected(out, incumbent))
            if not isinstance(results[i][1], AgentFailure):
                self.log(AgentDone(cid, agent.name, out.title))

        with ThreadPoolExecutor(max_workers=max(1, len(agents))) as pool:
            list(pool.map(work, range(len(agents))))
        return results

    def _judge(self, judge: Judge, candidates: list[tuple[str, Any]], incumbent: Recipe, inc_ws,
               round_id: int) -> list[Pending]:
        """Judge the candidates, as many at once as the judge has devices; results in candidate order."""
        one = progress.carried(lambda item: self._judge_one(judge, item[0], item[1], incumbent, inc_ws, round_id))
        if judge.parallel == 1:
            judged = [one(c) for c in candidates]
        else:
            with ThreadPoolExecutor(max_workers=judge.parallel) as pool:
                judged = list(pool.map(one, candidates))
        return [p for p in judged if p is not None]

    def _judge_one(self, judge: Judge, cid: str, out: Any, incumbent: Recipe, inc_ws,
                   round_id: int) -> Pending | None:
        from core.agents.base import AgentFailure
        from core.diffs import DiffError

        self._checkpoint()
        if self._stop:
            self.log(Notice(f"{cid} not judged: the run is stopping"))
            return None
        if isinstance(out, AgentFailure):
            self.log(CandidateFailed(cid, out.agent, out.reason))
            return None
        ws = self.workspace / cid
        try:
            self.workspace.write(cid, out.files)
        except DiffError as exc:  # the applies gate: nothing outside the allow-list is ever written
            self.log(CandidateFailed(cid, out.agent, f"diff did not apply: {exc}"))
            return None
        self.store.add_candidate(round_id, cid, out.agent, out.title, out.rationale, out.kind, out.diff,
                                 out.recipe.to_toml(), out.predicted_speedup)
        self.log(CandidateProposed(cid, out.agent, out.title, rationale=out.rationale, kind=out.kind, diff=out.diff,
                                   recipe=out.recipe.to_toml(), predicted_speedup=out.predicted_speedup))

        def on_gate(gate: str, passed: bool, detail: str, cid: str = cid) -> None:
            self.store.set_gate(cid, gate, passed, detail)
            self.log(GateChecked(cid, gate, passed, detail))

        def on_forcing(result: Forcing, cid: str = cid) -> None:
            self.store.add_forcing(cid, result.record)
            self.log(Forced.from_result(cid, result.record))

        def on_evaluation(split: str, result, cid: str = cid) -> None:
            self.log(Evaluated(cid, split, result.speedup, result.low, result.high, result.passed))

        with progress.step(f"judging {cid}"):
            verdict = judge.evaluate(out.recipe, incumbent, ws, inc_ws, on_gate, on_forcing, on_evaluation,
                                     diff=out.diff)
        for split, samples in verdict.samples.items():
            comp = getattr(verdict, split)  # None when the split's outputs failed forcing: no speedup
            self.store.add_evaluation(cid, split, {**(comp.to_dict() if comp else {"passed": False}),
                                                   "samples": samples.rows})
        failed = next((g for g, r in verdict.gates.items() if not r.passed), None)
        return Pending(cid, out.recipe, verdict.passed, failed, verdict, out)

    def _integrate(self, judge: Judge, approved: list[Pending], incumbent: Recipe, inc_ws):
        """One winner becomes the incumbent; several are combined and re-judged together."""
        if not approved:
            return incumbent, inc_ws, []
        best = max(approved, key=lambda p: p.verdict.heldout.speedup)
        choice, ws, evidence = best.recipe, self.workspace / best.cid, [best]
        if len(approved) > 1:
            ranked = sorted(approved, key=lambda p: -p.verdict.heldout.speedup)
            combined = combine(incumbent, [p.recipe for p in ranked])
            if combined is not None and combined != best.recipe:
                cid = f"{self.run_id}-r{self.round}-merge"
                self.log(Notice(f"integrating {len(approved)} winners into one recipe; re-judging"))
                merged_ws = self.workspace.merged(cid, [p.cid for p in approved])
                with progress.step("judging the combined winners"):
                    verdict = judge.evaluate(combined, best.recipe, merged_ws, ws)
                if verdict.passed:
                    self.log(Notice(f"combined recipe beats the best single winner "
                                    f"({verdict.heldout.speedup:.3f}x held-out)"))
                    return combined, merged_ws, approved
                self.log(Notice(f"combined recipe kept out ({verdict.reason}); "
                                f"taking {best.cid}"))
        return choice, ws, evidence

    def _unless_rejected(self, out: Any, incumbent: Recipe) -> Any:
        """A candidate that repeats a rejected change, without saying what differs, fails here: the person
        said no, whatever an agent (local or Claude) makes of the note."""
        from core.agents.base import AgentFailure, Candidate

        if not isinstance(out, Candidate) or out.differs.strip():
            return out
        hit = mem.rejection_of(out.recipe, incumbent, self.rejected)
        if hit is None:
            return out
        return AgentFailure(out.agent, f"proposed {out.title!r} again, which repeats {mem.rejection_line(hit)}; "
                                       "a repeat must say what differs")

    def _remember_rejections(self, pending: list[Pending], previous: Recipe) -> None:
        """Store each rejected candidate in memory so the run's later rounds, and a resumed run, do not
        propose it again."""
        for p in pending:
            if p.decision != "reject" or not p.recorded:
                continue
            entry = mem.rejection_entry(p.candidate.title, p.note, p.candidate.rationale, p.recipe, previous,
                                        self.config.deployment.fingerprint(),
                                        {"run": self.run_id, "round": self.round, "cid": p.cid})
            self.store.add_memory(entry)
            self.rejected.append(entry)

    def _remember(self, evidence: list[Pending], previous: Recipe) -> None:
        """Store each winner's mechanism with its held-out evidence."""
        for p in evidence:
            self.store.add_memory(mem.winner_entry(
                p.candidate.title, p.candidate.rationale, p.recipe, previous, self.config.deployment.fingerprint(),
                p.verdict.heldout, p.verdict.tuning, {"run": self.run_id, "round": self.round, "cid": p.cid},
                self.workspace / p.cid))

    @staticmethod
    def _candidate_summary(p: Pending) -> dict:
        v = p.verdict
        held = v.heldout
        return {"cid": p.cid, "agent": p.candidate.agent, "title": p.candidate.title,
                "gates": {g: r.passed for g, r in v.gates.items()},
                "verdict": "win" if p.passed else "fail", "reason": v.reason, "decision": p.decision,
                "predicted_speedup": p.candidate.predicted_speedup,
                "heldout_speedup": held.speedup if held else None,
                "interval": [held.low, held.high] if held else None,
                "forcing_rate": v.forcing.rate if v.forcing else None}


def _idle_reason(results: list[tuple[str, Any]]) -> str | None:
    """None when some agent proposed a candidate; else why none did, one agent per clause."""
    from core.agents.base import AgentFailure

    if not results or any(not isinstance(out, AgentFailure) for _, out in results):
        return None if results else "no agent ran"
    return "; ".join(f"{out.agent}: {out.reason}" for _, out in results)


def _refusals() -> tuple[type[BaseException], ...]:
    """Errors that mean the run could not begin (bad paths, files, options): no run is kept for them."""
    from core.engine import ModelLoadError
    from core.recipe import RecipeError
    from core.workload import WorkloadError

    return (ModelLoadError, WorkloadError, RecipeError, FileNotFoundError, ValueError)
