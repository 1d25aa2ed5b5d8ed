"""The rounds: measure -> propose (agents in parallel) -> judge -> decide -> integrate -> remember.

The loop runs in the caller's thread; agents run in their own threads; the judge serialises timing per
device. Each round returns a Round (core/loop/summary.py); the run's summary is built from them. Control
from other threads (core/loop/control.py), event persistence (core/loop/record.py), the workspace files
(core/loop/workspace.py) and memory (core/memory.py) live in their own modules.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specpilot.core import memory as mem
from specpilot.core import progress
from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.registry import directions, make_agents, parse_agents, uncovered
from specpilot.core.diffs import DiffError
from specpilot.core.engine import ModelLoadError
from specpilot.core.events import (AgentChunk, AgentDone, AgentStarted, CandidateFailed, CandidateProposed, Emit, Error,
                         Evaluated, Forced, GateChecked, Gaps, NewIncumbent, Notice, RoundFinished, RoundStarted,
                         RunFinished, RunStarted)
from specpilot.core.executors import make_executor
from specpilot.core.judge import Forcing, Judge
from specpilot.core.loop.config import LoopConfig, default_workdir
from specpilot.core.loop.control import Control, Pending
from specpilot.core.loop.summary import Round, Standing
from specpilot.core.loop.workspace import Workspace
from specpilot.core.recipe import Recipe, RecipeError, combine
from specpilot.core.recipe import stock as deployment_stock
from specpilot.core.setup import RunContext, prepare
from specpilot.core.stats import Comparison
from specpilot.core.store import Store
from specpilot.core.workload import WorkloadError

# Errors that mean the run could not begin (bad paths, files, options): no run is kept for them.
REFUSALS = (ModelLoadError, WorkloadError, RecipeError, FileNotFoundError, ValueError)


class Loop(Control):
    """The real core behind `specpilot run` and `specpilot-tui` (implements core.events.LoopHandle)."""

    def __init__(self, config: LoopConfig) -> None:
        self.config = config
        self.counts = dict(parse_agents(config.agents))
        if self.counts.get("claude"):
            from specpilot.core.agents.claude import require_api_key  # anthropic: only a run with Claude agents needs it

            require_api_key()
        self.executor = make_executor(config.executor, config.deployment, config.devices, config.ray_address)
        super().__init__(Store(config.db))
        self.status: str | None = None  # how the run ended: finished, stopped, failed, interrupted
        self.rejected: list[dict] = []  # this run's rejections (memory entries), given to every agent
        self.memory: list[dict] = []  # the validated mechanisms every agent starts from
        self._finished = 0  # the last finished round's index
        self.rounds: list[Round] = []  # the rounds this process finished, in order (the summary lists them)
        self._uncovered: set[str] = set()  # gap components already said to have no agent
        # set up by _prepare, once the run exists: its workspace, the loaded models, the calibrated judge
        self.workspace: Workspace | None = None
        self.ctx: RunContext | None = None
        self.judge: Judge | None = None
        self.stock = deployment_stock(config.deployment.drafter is not None)
        self.stock_vs_ar: Comparison | None = None  # stock's held-out speedup over AR, from calibration
        # what the next round starts from: stock, a resumed run's last incumbent, or the last round's winner
        self.incumbent: Recipe = self.stock
        self.incumbent_ws: Path | None = None  # the incumbent's plugin code, when it has any
        self.standing: Standing | None = None

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
            if self.round == 0 and cfg.resume is None and isinstance(exc, REFUSALS):
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
        """Prepare, then one round after another until the last, a stop, the time budget, or a round in
        which no agent proposed anything; returns the run's summary."""
        cfg = self.config
        last = self._prepare()
        started = time.monotonic()
        stopped_by = stop_reason = None
        for index in range(last + 1, cfg.rounds + 1):
            if self._stop or stop_reason:
                break
            if cfg.time_budget_s is not None and time.monotonic() - started > cfg.time_budget_s:
                stopped_by = f"time budget of {cfg.time_budget_s / 60:.1f} min spent after round {index - 1}"
                self.log(Notice(f"stopping: {stopped_by}"))
                self._stop = True
                break
            done = self._round(index)
            self.rounds.append(done)
            if done.idle and index < cfg.rounds:
                stop_reason = f"round {index} had no candidate ({done.idle}); the incumbent is unchanged, so later " \
                              "rounds would propose from the same state"
                self.log(Notice(f"stopping early: {stop_reason}"))
        summary = {"run": self.run_id, "deployment": cfg.deployment.to_dict(), "noise_floor": self.judge.floor,
                   "stock_heldout_speedup_vs_ar": self.stock_vs_ar.speedup,
                   "rounds": [r.to_dict() for r in self.rounds], "stopped_by": stopped_by}
        if stop_reason:
            summary["stopped_early"] = stop_reason
        return summary

    def _prepare(self) -> int:
        """What the rounds need, once: memory, the workspace, the models, the judge calibrated on stock, and
        the incumbent to start from (stock, or a resumed run's last); returns the last finished round."""
        cfg, d = self.config, self.config.deployment
        self.memory, self.rejected = mem.split(self.store.memory(d.fingerprint()), self.run_id)
        last, resumed = self._resumed()
        self._finished = last
        self._announce(last, resumed)
        self.workspace = Workspace(Path(cfg.workdir or default_workdir(cfg.db)) / f"run-{self.run_id}")
        self._state("preparing")
        with progress.step("loading the models and timing AR decoding"):
            ctx = self.ctx = prepare(d, cfg.max_requests, cfg.max_new_tokens, cfg.seed)
        self._state("measuring")
        self.judge = Judge(d, ctx.tuning, ctx.heldout, ctx.force, self._call_limit(ctx), cfg.seed,
                           executor=self.executor)
        with progress.step("calibration"):
            calibration = self.judge.calibrate(self.stock, self.stock, versus_ar=ctx.heldout)
        self.log(Notice(f"noise floor {calibration['noise_floor']:.3f} (A/A, {len(calibration['aa_samples'])} "
                        f"paired timings of {len(ctx.tuning)} tuning requests: bias {calibration['aa_bias']:+.3f}, "
                        f"spread {calibration['aa_spread']:.3f}); stock forcing rate "
                        f"{calibration['stock_forcing']['rate']:.4f}"))
        self.stock_vs_ar = calibration["incumbent_vs_ar"]
        self.standing = Standing.of_stock(self.stock_vs_ar)
        if resumed:
            self.incumbent = Recipe.from_toml(resumed["recipe"], source=f"run {self.run_id} round {last}")
            self.incumbent_ws = Path(resumed["workspace"]) if resumed.get("workspace") else None
            self.standing = Standing.from_payload(resumed)
        return last

    def _announce(self, last: int, resumed: dict | None) -> None:
        """The run's first events: what it is, what it resumes from, and the memory it starts with."""
        cfg, d = self.config, self.config.deployment
        self.log(RunStarted(self.run_id, d.to_dict(), [cfg.agents], cfg.auto, memory=len(self.memory),
                            resumed_after_round=last or None))
        if cfg.resume is not None:
            self.log(Notice(f"resuming run {self.run_id} after round {last} of {cfg.rounds}"
                            + (f", from its incumbent {resumed['recipe'].splitlines()[0]}"
                            if resumed else ", from stock")))
        if self.memory:
            here = sum(1 for m in self.memory if m.get("fingerprint") == d.fingerprint())
            self.log(Notice(f"memory: starting from {len(self.memory)} validated mechanism(s) "
                            f"({here} from this deployment)"))

    def _round(self, index: int) -> Round:
        """One round: measure the incumbent, propose, judge, decide, integrate, remember. It is stored whole
        when it finishes (or not at all), and the incumbent it ends with is the next round's."""
        self._checkpoint()
        self.round = index
        self.log(RoundStarted(index))
        report, tools, round_id = self._measure(index)
        self._checkpoint()
        self._say_uncovered(report)
        candidates = self._propose(index, report, tools)
        idle = _idle_reason(candidates)
        if idle:
            self.log(Notice(f"round {index}: no candidate: {idle}"))
        self._state("judging")
        pending = self._judge(candidates, round_id)
        approved = self.await_decisions(pending, self.config.auto)
        self._checkpoint()
        previous = self.incumbent
        evidence = self._advance(index, approved)
        ceiling = report["ceiling_tokens_per_s"] / self.ctx.ar_tokens_per_s if self.ctx.ar_tokens_per_s else None
        inc = NewIncumbent(round=index, recipe=self.incumbent.to_toml(), **self.standing.to_dict(),
                           ceiling_speedup_vs_ar=ceiling, stock_speedup_vs_ar=self.stock_vs_ar.speedup,
                           workspace=str(self.incumbent_ws) if self.incumbent_ws else None)
        progress.check()
        with self.log.lock, self.store.transaction():  # a finished round is stored whole, or not at all
            self._remember(evidence, previous)
            self._remember_rejections(pending, previous)
            self.log(inc)
            self.log(RoundFinished(index))
            self.store.finish_round(round_id, inc.to_payload())
        self._finished = index
        return Round.of(index, report, pending, self.incumbent, self.standing, idle)

    def _measure(self, index: int) -> tuple[dict, Any, int]:
        """The incumbent's cost report, the cost model the agents may ask (rebuilt from that report, since
        the incumbent may have changed), and the round as stored with its gaps."""
        self._state("measuring")
        with progress.step("gap analysis"):
            report = self.ctx.analyse(self.incumbent)
            tools = self.ctx.tools_for(report, self.incumbent)
        self.log(Gaps(index, measured_tokens_per_s=report["measured_tokens_per_s"],
                      ceiling_tokens_per_s=report["ceiling_tokens_per_s"], gaps=report["gaps"],
                      largest_gap=report["largest_gap"], drift=report.get("drift")))
        round_id = self.store.start_round(self.run_id, index, {k: report[k] for k in (
            "measured_tokens_per_s", "ceiling_tokens_per_s", "gaps", "largest_gap")})
        return report, tools, round_id

    def _advance(self, index: int, approved: list[Pending]) -> list[Pending]:
        """Make the approved winners the incumbent (timed against AR and stock on the held-out requests);
        returns the winners it was made from (none when the incumbent stays)."""
        self._state("integrating")
        new, new_ws, evidence = self._integrate(approved)
        if new is not self.incumbent:
            new = new.replace(name=f"run{self.run_id}-round{index}")
            with progress.step("timing the new incumbent against AR and stock"):
                vs_ar, vs_stock = self.judge.standing(new, self.stock, self.ctx.heldout, new_ws)
            self.standing = Standing.measured(vs_ar, vs_stock)
            self.incumbent, self.incumbent_ws = new, new_ws
        return evidence

    # -- steps ----------------------------------------------------------------------------------------

    def _call_limit(self, ctx: RunContext) -> float:
        """A worker's wall-clock limit per request: the configured one, or ten times what our AR takes for
        the longest request (a 1.5B model in float32 decodes 128 tokens in about a minute here)."""
        longest = max((r.max_new_tokens for r in ctx.tuning + ctx.heldout), default=0)
        if not ctx.ar_tokens_per_s:
            return self.config.limit_s
        return max(self.config.limit_s, 10 * longest / ctx.ar_tokens_per_s)

    def _propose(self, index: int, report: dict, tools: Any) -> list[tuple[str, Any]]:
        """Every agent of the run on the largest gaps, in parallel; when none proposes anything, the agents
        not yet tried on the next gaps."""
        self._state("proposing")
        cfg = self.config
        agents = make_agents(cfg.agents, cfg.seed + index, cfg.model, report=report, memory=self.memory,
                             incumbent=self.incumbent, only=cfg.local_agents)
        results = self._run_agents(index, agents, directions(report, len(agents)), 0, report, tools)
        if _idle_reason(results):  # nothing for the largest gaps: the agents not yet tried, on the next gaps
            tried = tuple(a.name for a in agents)
            more = make_agents(cfg.agents, cfg.seed + index, cfg.model, report=report, memory=self.memory,
                               incumbent=self.incumbent, only=cfg.local_agents, skip=tried)
            if more:
                self.log(Notice(f"no candidate for the largest gaps; trying "
                                f"{', '.join(a.name for a in more)} on the next ones"))
                dirs = directions(report, len(agents) + len(more))[len(agents):]
                results += self._run_agents(index, more, dirs, len(agents), report, tools)
        return results

    def _say_uncovered(self, report: dict) -> None:
        """Once per run, one line for each gap component that no agent of this run can act on."""
        for component in uncovered(report, self.counts, self.config.local_agents):
            if component not in self._uncovered:
                self._uncovered.add(component)
                ms = next((g.get("ms_per_token", 0.0) for g in report.get("gaps", [])
                           if g.get("component") == component), 0.0)
                self.log(Notice(f"no agent of this run acts on the {component} gap "
                                f"({ms:.2f} ms/token)"))

    def _run_agents(self, index: int, agents: list, dirs: list[str], offset: int, report: dict,
                    tools: Any) -> list[tuple[str, Any]]:
        """Run `agents` in parallel threads; candidate ids continue after `offset`."""
        results: list[tuple[str, Any]] = [None] * len(agents)
        incumbent = self.incumbent

        def work(i: int) -> None:
            agent = agents[i]
            cid = f"{self.run_id}-r{index}-c{offset + i + 1}"  # unique across the store: runs share it
            ws = self.workspace.for_candidate(cid, self.incumbent_ws)
            self.log(AgentStarted(cid, agent.name, dirs[i]))
            context = AgentContext(deployment=self.config.deployment.to_dict(), recipe=incumbent, cost_report=report,
                                   memory=self.memory, direction=dirs[i], workspace=ws,
                                   tuning_summary=self.ctx.tuning_summary, seed=self.config.seed + index,
                                   tools=tools, rejected=list(self.rejected))
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

    def _judge(self, candidates: list[tuple[str, Any]], round_id: int) -> list[Pending]:
        """Judge the candidates, as many at once as the judge has devices; results in candidate order."""
        one = progress.carried(lambda item: self._judge_one(item[0], item[1], round_id))
        if self.judge.parallel == 1:
            judged = [one(c) for c in candidates]
        else:
            with ThreadPoolExecutor(max_workers=self.judge.parallel) as pool:
                judged = list(pool.map(one, candidates))
        return [p for p in judged if p is not None]

    def _judge_one(self, cid: str, out: Any, round_id: int) -> Pending | None:
        """One candidate through the judge's gates against the incumbent, each gate stored and emitted."""
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

        def on_evaluation(split: str, result: Comparison, cid: str = cid) -> None:
            self.log(Evaluated(cid, split, result.speedup, result.low, result.high, result.passed))

        with progress.step(f"judging {cid}"):
            verdict = self.judge.evaluate(out.recipe, self.incumbent, ws, self.incumbent_ws, on_gate, on_forcing,
                                          on_evaluation, diff=out.diff)
        for split, samples in verdict.samples.items():
            comp = getattr(verdict, split)  # None when the split's outputs failed forcing: no speedup
            self.store.add_evaluation(cid, split, {**(comp.to_dict() if comp else {"passed": False}),
                                                   "samples": samples.rows})
        failed = next((g for g, r in verdict.gates.items() if not r.passed), None)
        return Pending(cid, out.recipe, verdict.passed, failed, verdict, out)

    def _integrate(self, approved: list[Pending]) -> tuple[Recipe, Path | None, list[Pending]]:
        """One winner becomes the incumbent; several are combined and re-judged together. Returns the new
        incumbent, its workspace and the winners it holds (the incumbent itself when none was approved)."""
        if not approved:
            return self.incumbent, self.incumbent_ws, []
        best = max(approved, key=lambda p: p.verdict.heldout.speedup)
        choice, ws, evidence = best.recipe, self.workspace / best.cid, [best]
        if len(approved) > 1:
            ranked = sorted(approved, key=lambda p: -p.verdict.heldout.speedup)
            combined = combine(self.incumbent, [p.recipe for p in ranked])
            if combined is not None and combined != best.recipe:
                cid = f"{self.run_id}-r{self.round}-merge"
                self.log(Notice(f"integrating {len(approved)} winners into one recipe; re-judging"))
                merged_ws = self.workspace.merged(cid, [p.cid for p in approved])
                with progress.step("judging the combined winners"):
                    verdict = self.judge.evaluate(combined, best.recipe, merged_ws, ws)
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


def _idle_reason(results: list[tuple[str, Any]]) -> str | None:
    """None when some agent proposed a candidate; else why none did, one agent per clause."""
    if not results or any(not isinstance(out, AgentFailure) for _, out in results):
        return None if results else "no agent ran"
    return "; ".join(f"{out.agent}: {out.reason}" for _, out in results)
