"""The judge: evaluates a candidate recipe against the incumbent without ever running candidate code.

Candidates run in workers (core/workers.py) that an executor (core/executors) places on a device; the judge
holds one timing slot per device and runs one A/B comparison at a time on each, so candidates are judged in
parallel on several devices, each comparison entirely on its own. Trusted recipes (stock, autoregressive
decoding, an incumbent without plugin code) run on the slot's resident baseline worker that never loads a
workspace. The judge times each request from its side of the call, alternating incumbent and candidate
request by request (each request once: a candidate never sees a held-out prompt before it is timed), and
runs token forcing itself on everything a candidate emitted, timed runs included: a worker's own stats and
timings are never used. Gates run in order, cheapest first: applies -> smoke -> forcing -> tuning ->
heldout; each is one method below.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from specpilot.core import progress
from specpilot.core.diffs import PLUGIN_GLOB, RECIPE_FILE, AllowList, DiffError, apply_edits, parse_agent_output, workspace_files
from specpilot.core.deployment import Deployment
from specpilot.core.events import GATES
from specpilot.core.executors import Device, Executor
from specpilot.core.executors.local import LocalExecutor, device_lock, timing_cpus
from specpilot.core.mechanisms import UnknownMechanism, check_recipe
from specpilot.core.recipe import Recipe, RecipeError
from specpilot.core.stats import Comparison, Noise, compare, noise, speedups
from specpilot.core.workers import (KEEP, SECRET_ENV, START_LIMIT_S, Bound, JudgeRequest, Worker, WorkerBase, WorkerError,
                          WorkerTimeout)

__all__ = ["Judge", "Verdict", "Gate", "Samples", "Forcing", "JudgeRequest", "Worker", "WorkerBase", "WorkerError", "WorkerTimeout", "Bound",
           "KEEP", "SECRET_ENV", "START_LIMIT_S", "device_lock", "timing_cpus", "diff_applies"]


@dataclass(frozen=True)
class Gate:
    """One gate's outcome, and the line that says why."""

    passed: bool
    detail: str


@dataclass
class Samples:
    """Paired timings of one A/B comparison, request by request (seconds and tokens/s of each side)."""

    rows: list[dict] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Per-request speedups of the candidate side over the incumbent side."""
        return speedups([s["incumbent_tps"] for s in self.rows], [s["candidate_tps"] for s in self.rows])

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Forcing:
    """The judge's token forcing of one set of outputs: passed when the mismatch rate is within the threshold.
    `error` says why outputs could not be scored (then rate is 1 and the counts None); `record` is everything
    the forcer reported, as the store keeps it."""

    passed: bool
    rate: float
    threshold: float
    tokens: int | None = None
    mismatches: int | None = None
    near_ties: int | None = None
    error: str | None = None
    record: dict = field(default_factory=dict)

    @property
    def why(self) -> str:
        """The gate's one line: the error, or the rate against the threshold."""
        return self.error or f"mismatch rate {self.rate:.4f} vs threshold {self.threshold:.4f}"


@dataclass
class Verdict:
    gates: dict[str, Gate] = field(default_factory=dict)
    forcing: Forcing | None = None
    tuning: Comparison | None = None
    heldout: Comparison | None = None
    samples: dict[str, Samples] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates.values()) and "heldout" in self.gates

    @property
    def reason(self) -> str:
        failed = next((f"{name}: {g.detail}" for name, g in self.gates.items() if not g.passed), None)
        return failed or "passed every gate"


Forcer = Callable[[list[JudgeRequest], list[list[int]], Recipe], dict]
Pair = tuple[JudgeRequest, list[int]]  # a request and one output a worker emitted for it
GateHook = Callable[[str, bool, str], None]


@dataclass
class Slot:
    """One device's timing slot and its resident baseline worker (started when first needed)."""

    device: Device
    baseline: WorkerBase | None = None


@dataclass
class Trial:
    """One evaluation in flight: what is judged against what, where, and what it has shown so far."""

    recipe: Recipe
    incumbent: Recipe
    workspace: str | Path | None
    incumbent_workspace: str | Path | None
    on_gate: GateHook | None = None
    on_forcing: Callable[[Forcing], None] | None = None
    on_evaluation: Callable[[str, Comparison], None] | None = None
    diff: str | None = None
    verdict: Verdict = field(default_factory=Verdict)
    slot: Slot | None = None
    cand: WorkerBase | None = None
    inc: WorkerBase | None = None  # the incumbent's own worker, when it comes with plugin code
    inc_ready: bool = False

    def gate(self, name: str, passed: bool, detail: str) -> bool:
        self.verdict.gates[name] = Gate(passed, detail)
        if self.on_gate:
            self.on_gate(name, passed, detail)
        return passed


class Judge:
    """Gates and timing for one deployment's tuning and held-out requests, on the executor's devices.

    Every candidate, and any incumbent with plugin code, gets a fresh worker of its own on the slot that
    judges it. `close()` ends the baseline workers and releases the executor."""

    def __init__(self, deployment: Deployment, tuning: list[JudgeRequest], heldout: list[JudgeRequest],
                 force: Forcer, limit_s: float = 120.0, seed: int = 0, start_limit_s: float | None = None,
                 executor: Executor | None = None, aa_samples: int = 12) -> None:
        self.deployment = deployment
        self.tuning = tuning
        self.heldout = heldout
        self.force = force
        self.limit_s = limit_s
        self.start_limit_s = start_limit_s
        self.seed = seed
        self.aa_samples = aa_samples
        self.noise = Noise(0.0, 0.0, 0)
        self.floor = 0.0
        self.stock_rate: float | None = None
        self.executor = executor if executor is not None else LocalExecutor(deployment)
        self.slots = [Slot(d) for d in self.executor.devices]
        self._free: "queue.Queue[Slot]" = queue.Queue()
        for slot in self.slots:
            self._free.put(slot)
        self._forcing = threading.Lock()  # one reference model in this process: its passes take turns

    @property
    def parallel(self) -> int:
        """How many candidates can be judged at once: one per device."""
        return len(self.slots)

    def worker(self, recipe: Recipe | None, workspace: str | Path | None = None, start: bool = True,
               slot: Slot | None = None) -> WorkerBase:
        """A fresh worker for `recipe` on `slot`'s device (the first slot's by default)."""
        device = (slot or self.slots[0]).device
        w = self.executor.start(self.deployment, recipe, workspace, device, self.limit_s, self.start_limit_s)
        return w.ready() if start else w

    @contextmanager
    def _slot(self) -> Iterator[Slot]:
        """A free device for one measurement, held until it ends: two measurements never share a device."""
        slot = self._free.get()
        try:
            with slot.device.lock:
                yield slot
        finally:
            self._free.put(slot)

    def _start(self, slot: Slot, specs: list[tuple[Recipe | None, str | Path | None]],
               baseline: bool = False) -> list[WorkerBase]:
        """Start fresh workers on `slot` (and its baseline worker, if asked and not running) at once: their
        engines load in parallel, before anything is timed. All are ready on return, or none is left running."""
        started: list[WorkerBase] = []
        fresh: list[WorkerBase] = []
        try:
            if baseline and (slot.baseline is None or not slot.baseline.alive):
                slot.baseline = self.worker(None, None, start=False, slot=slot)
                started.append(slot.baseline)
            fresh = [self.worker(recipe, workspace, start=False, slot=slot) for recipe, workspace in specs]
            started += fresh
            for w in started:
                w.ready()
        except BaseException:
            for w in started:
                w.close()
            raise
        return fresh

    @staticmethod
    def _bound(slot: Slot, recipe: Recipe | None) -> Bound:
        assert slot.baseline is not None
        return Bound(slot.baseline, recipe)

    def close(self) -> None:
        """End the resident baseline workers and release the executor (a later measurement starts anew)."""
        for slot in self.slots:
            if slot.baseline is not None:
                slot.baseline.close()
                slot.baseline = None
        self.executor.close()

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def threshold(self) -> float:
        """The forcing threshold: stock's own mismatch rate in this run + 0.5 percentage points at f32 (the
        reference is another program); 0 under other numerics, whose reference is the deployment's own decoding."""
        if self.deployment.numerics != "f32":
            return 0.0
        return (self.stock_rate or 0.0) + 0.005

    def calibrate(self, incumbent: Recipe, stock: Recipe, versus_ar: list[JudgeRequest] | None = None) -> dict:
        """A/A noise (the incumbent on the baseline worker against the incumbent on a fresh worker, as
        candidates are measured, over the tuning requests repeated until there are `aa_samples` pairs) and
        stock's own forcing rate on the tuning set; with `versus_ar`, also the incumbent's speedup over our
        autoregressive decoding on those requests."""
        same = incumbent.to_toml() == stock.to_toml()
        with self._slot() as slot:
            (fresh,) = self._start(slot, [(incumbent, None)], baseline=True)
            try:
                samples = self._aa(slot, incumbent, fresh)
                stock_side = fresh if same else self._bound(slot, stock)
                stock_outputs = _each("stock outputs for forcing", self.tuning, stock_side.timed)
                vs_ar = None
                if versus_ar:
                    with progress.step("stock vs AR"):
                        _, ar_samples = self._ab(self._bound(slot, None), fresh, versus_ar)
                    vs_ar = self._compare(ar_samples.ratios())
            finally:
                fresh.close()
        with self._forcing:
            stock_forcing = self.force([r for r, _ in stock_outputs], [t for _, t in stock_outputs], stock)
        self.stock_rate = stock_forcing["rate"]
        return {"noise_floor": self.floor, "aa_bias": self.noise.bias, "aa_spread": self.noise.spread,
                "aa_samples": samples.rows, "stock_forcing": stock_forcing,
                "incumbent_vs_ar": vs_ar}

    def calibrate_noise(self, incumbent: Recipe) -> Samples:
        """Only the A/A half of `calibrate`: the floor and spread for `incumbent`, and the paired samples."""
        with self._slot() as slot:
            (fresh,) = self._start(slot, [(incumbent, None)], baseline=True)
            try:
                return self._aa(slot, incumbent, fresh)
            finally:
                fresh.close()

    def _aa(self, slot: Slot, incumbent: Recipe, fresh: WorkerBase) -> Samples:
        """The incumbent on the baseline worker against `fresh`, over the tuning requests repeated until
        there are `aa_samples` pairs; sets the run's noise and floor."""
        repeats = max(1, -(-self.aa_samples // max(1, len(self.tuning))))
        with progress.step("A/A noise floor"):
            _, samples = self._ab(self._bound(slot, incumbent), fresh, self.tuning * repeats)
        self.noise = noise(samples.ratios())
        self.floor = self.noise.floor
        return samples

    def _rotate(self, workers: list[WorkerBase | Bound], requests: list[JudgeRequest],
                warm: JudgeRequest | None = None) -> tuple[list[list[dict]], list[list[Pair]]]:
        """Time every request once on every worker, rotating who goes first request by request (A B, then
        B A, ...), all of them warmed up first on `warm` (default: the first tuning request, one every
        worker has already seen, so no timed request is ever one a candidate saw before). Tokens per second
        count at most max_new_tokens (padding buys no speed).

        Returns, per worker, one {seconds, tps} per request, and the (request, output) pairs it emitted."""
        warm = warm or (self.tuning[0] if self.tuning else (requests[0] if requests else None))
        if warm is not None:
            for w in workers:
                w.warm_up(warm)
        n = len(workers)
        timings: list[list[dict]] = [[] for _ in workers]
        outputs: list[list[Pair]] = [[] for _ in workers]
        with progress.step("timing requests", len(requests)):
            for i, req in enumerate(requests):
                for k in range(n):
                    j = (i + k) % n
                    tokens, seconds = workers[j].timed(req)
                    timings[j].append({"seconds": seconds, "tps": min(len(tokens), req.max_new_tokens) / seconds})
                    outputs[j].append((req, tokens))
                progress.advance()
        return timings, outputs

    def _ab(self, incumbent: WorkerBase | Bound, candidate: WorkerBase | Bound,
            requests: list[JudgeRequest]) -> tuple[list[Pair], Samples]:
        """Incumbent against candidate, request by request: the candidate's outputs and the paired samples."""
        (inc, cand), (_, outputs) = self._rotate([incumbent, candidate], requests)
        return outputs, Samples([{"request": req.id, "incumbent_s": a["seconds"], "candidate_s": b["seconds"],
                                  "incumbent_tps": a["tps"], "candidate_tps": b["tps"]}
                                 for req, a, b in zip(requests, inc, cand)])

    def _forced(self, outputs: list[Pair], recipe: Recipe) -> Forcing:
        """The judge's own token forcing of a candidate's outputs; outputs it cannot even score fail."""
        requests = [r for r, _ in outputs]
        try:
            with self._forcing:
                result = dict(self.force(requests, [t for _, t in outputs], recipe))
        except Exception as exc:  # e.g. token ids outside the vocabulary, or a rule forcing cannot check
            error = f"forcing could not score the outputs: {type(exc).__name__}: {exc}"[:500]
            tokens = sum(r.max_new_tokens for r in requests)
            record = {"tokens": tokens, "mismatches": None, "rate": 1.0, "near_ties": None,
                      "threshold": self.threshold, "passed": False, "error": error}
            return Forcing(False, 1.0, self.threshold, tokens, error=error, record=record)
        passed = result["rate"] <= self.threshold
        record = {**result, "threshold": self.threshold, "passed": passed}
        return Forcing(passed, result["rate"], self.threshold, result.get("tokens"), result.get("mismatches"),
                       result.get("near_ties"), None, record)

    def evaluate(self, recipe: Recipe, incumbent: Recipe, workspace: str | Path | None = None,
                 incumbent_workspace: str | Path | None = None, on_gate: GateHook | None = None,
                 on_forcing: Callable[[Forcing], None] | None = None,
                 on_evaluation: Callable[[str, Comparison], None] | None = None, diff: str | None = None) -> Verdict:
        """Run the gates for `recipe` against `incumbent` on a free device; stops at the first failed gate.
        With `diff` (the candidate's, as shown to people), the applies gate checks that it makes exactly this
        recipe and workspace from the incumbent's. Safe to call from several threads: one per device runs.

        Only the judge's own measurements decide: its timings around each round trip and its own forcing
        of every output the candidate emitted (the forcing run and the timed runs alike)."""
        trial = Trial(recipe, incumbent, workspace, incumbent_workspace, on_gate, on_forcing, on_evaluation, diff)
        if not self._applies(trial):
            return trial.verdict
        with self._slot() as slot:
            trial.slot = slot
            try:
                for gate in (self._smoke, self._forcing_gate, self._tuning, self._heldout):
                    if not gate(trial):
                        break
            except WorkerError as exc:
                self._crashed(trial, exc)
            finally:
                for w in (trial.cand, trial.inc):
                    if w is not None:
                        w.close()
        return trial.verdict

    def _applies(self, t: Trial) -> bool:
        """The diff applies to a clean workspace and makes exactly what will run; every mechanism the recipe
        names exists (built in, or declared by the workspace's plugins). No worker is started for this."""
        made = ""
        if t.diff is not None:
            try:
                made = diff_applies(t.diff, t.recipe, t.incumbent, t.workspace, t.incumbent_workspace) + "; "
            except (DiffError, RecipeError) as exc:
                return t.gate("applies", False, f"diff did not apply: {exc}")
        try:
            check_recipe(t.recipe, t.workspace)
        except UnknownMechanism as exc:
            return t.gate("applies", False, str(exc))
        return t.gate("applies", True, made + "recipe validated")

    def _smoke(self, t: Trial) -> bool:
        """The candidate's worker starts (next to the incumbent's own, if it has one, and the slot's baseline)
        and answers a short request within max_new_tokens."""
        assert t.slot is not None
        own = _has_plugins(t.incumbent_workspace)  # plugin code never enters the baseline worker
        try:
            if not own and (t.slot.baseline is None or not t.slot.baseline.alive):
                self._start(t.slot, [], baseline=True)
        except WorkerError as exc:
            return t.gate("smoke", False, f"the judge's baseline worker failed to start, so nothing could be "
                                          f"judged: {exc}")
        try:
            t.cand = self.worker(t.recipe, t.workspace, start=False, slot=t.slot)
            if own:
                t.inc = self.worker(t.incumbent, t.incumbent_workspace, start=False, slot=t.slot)
            t.cand.ready()
        except WorkerError as exc:
            return t.gate("smoke", False, f"worker failed to start: {exc}")
        probe = self.tuning[0]
        short = JudgeRequest(probe.id, probe.index, probe.prompt, min(8, probe.max_new_tokens))
        tokens, _ = t.cand.timed(short)
        if len(tokens) > short.max_new_tokens:
            return t.gate("smoke", False, f"emitted {len(tokens)} tokens for max_new_tokens {short.max_new_tokens}")
        return t.gate("smoke", True, f"{len(tokens)} tokens on a short request")

    def _forcing_gate(self, t: Trial) -> bool:
        """The candidate's outputs on every tuning request, forced on the reference here: lossless or out."""
        assert t.cand is not None
        outputs = _each("outputs for token forcing", self.tuning, t.cand.timed)
        forcing = self._forced(outputs, t.recipe)
        t.verdict.forcing = forcing
        if t.on_forcing:
            t.on_forcing(forcing)
        return t.gate("forcing", forcing.passed, forcing.why)

    def _tuning(self, t: Trial) -> bool:
        """Faster than the incumbent on the tuning requests, beyond the noise floor."""
        if t.inc is not None and not t.inc_ready:
            try:
                t.inc.ready()
            except WorkerError as exc:
                return t.gate("tuning", False, f"the incumbent's worker failed to start, so nothing could be timed: "
                                               f"{exc}")
            t.inc_ready = True
        return self._split(t, "tuning", self.tuning)

    def _heldout(self, t: Trial) -> bool:
        """Faster again on held-out requests, which no candidate saw before it was timed on them."""
        return self._split(t, "heldout", self.heldout)

    def _split(self, t: Trial, split: str, requests: list[JudgeRequest]) -> bool:
        """A/B against the incumbent on `requests`; the timed outputs are forced too."""
        assert t.slot is not None and t.cand is not None
        incumbent_side = t.inc if t.inc is not None else self._bound(t.slot, t.incumbent)
        with progress.step(f"{split} A/B"):
            timed_outputs, samples = self._ab(incumbent_side, t.cand, requests)
        t.verdict.samples[split] = samples
        check = self._forced(timed_outputs, t.recipe)
        if not check.passed:
            return t.gate(split, False, f"the outputs timed on {split} requests fail token forcing ({check.why})")
        result = self._compare(samples.ratios())
        setattr(t.verdict, split, result)
        if t.on_evaluation:
            t.on_evaluation(split, result)
        return t.gate(split, result.passed, f"speedup {result.speedup:.3f}x [{result.low:.3f}, {result.high:.3f}] "
                                            f"needs low > {1 + self.floor:.3f} (1 + noise floor {self.floor:.3f})")

    @staticmethod
    def _crashed(t: Trial, exc: WorkerError) -> None:
        """A worker error fails the gate in flight: the incumbent's side, a timeout, or the candidate."""
        if exc.worker is not None and exc.worker is not t.cand:  # the incumbent's side, not the candidate
            t.gate(_next_gate(t.verdict), False, f"the incumbent's worker failed, so the candidate could not be "
                                                 f"judged: {exc}")
        elif isinstance(exc, WorkerTimeout):
            t.gate(_next_gate(t.verdict), False, str(exc))
        else:
            t.gate(_next_gate(t.verdict), False, f"candidate crashed: {exc}")

    def measure(self, baseline: Recipe | None, recipe: Recipe, requests: list[JudgeRequest],
                workspace: str | Path | None = None) -> Comparison:
        """Speedup of `recipe` (on a fresh worker with `workspace`) over `baseline` (None = our autoregressive
        decoding; on the baseline worker, which never loads a workspace: a plugin cannot slow its baseline)."""
        with self._slot() as slot:
            (fresh,) = self._start(slot, [(recipe, workspace)], baseline=True)
            try:
                _, samples = self._ab(self._bound(slot, baseline), fresh, requests)
            finally:
                fresh.close()
        return self._compare(samples.ratios())

    def standing(self, recipe: Recipe, stock: Recipe, requests: list[JudgeRequest],
                 workspace: str | Path | None = None) -> tuple[Comparison, Comparison]:
        """(speedup over our autoregressive decoding, speedup over stock) of an approved `recipe` on
        `requests`, timed in rotation: AR and stock on the baseline worker, and `recipe` too unless it
        comes with plugin code (then on a fresh worker with `workspace`)."""
        with self._slot() as slot:
            own = _has_plugins(workspace)
            fresh = self._start(slot, [(recipe, workspace)] if own else [], baseline=True)
            try:
                sides = [self._bound(slot, None), self._bound(slot, stock),
                         fresh[0] if own else self._bound(slot, recipe)]
                (ar, base, new), _ = self._rotate(sides, requests)
            finally:
                for w in fresh:
                    w.close()
        rates = [[s["tps"] for s in side] for side in (ar, base, new)]
        return self._compare(speedups(rates[0], rates[2])), self._compare(speedups(rates[1], rates[2]))

    def _compare(self, ratios: list[float]) -> Comparison:
        """A comparison against this run's noise: its floor, and its spread where a sample is too small."""
        return compare(ratios, self.floor, self.seed, self.noise.spread)


def diff_applies(diff: str, recipe: Recipe, incumbent: Recipe, workspace: str | Path | None,
                 incumbent_workspace: str | Path | None) -> str:
    """The applies gate's check: `diff`, applied strictly (core/diffs.py) to a clean copy of what the
    agent was given (the incumbent's recipe and plugins), makes exactly `recipe` and exactly the plugin
    files in `workspace`, so what is judged is what people were shown. Raises DiffError saying what differs;
    returns a one-line summary."""
    clean = workspace_files(incumbent_workspace, incumbent)
    edits = parse_agent_output(diff)
    if not edits:
        raise DiffError("the candidate's diff has no edits")
    made = apply_edits(edits, clean, AllowList((RECIPE_FILE, PLUGIN_GLOB)))
    if Recipe.from_toml(made[RECIPE_FILE], source=RECIPE_FILE).to_toml() != recipe.to_toml():
        raise DiffError(f"{RECIPE_FILE}: the diff does not make the candidate's recipe")
    there = workspace_files(workspace, incumbent)
    there.pop(RECIPE_FILE)
    made.pop(RECIPE_FILE)
    for path in sorted(set(made) | set(there)):
        if made.get(path) != there.get(path):
            what = "is not in the workspace" if path not in there else (
                "is in the workspace but not in the diff" if path not in made else "differs from what the diff makes")
            raise DiffError(f"{path} {what}; only code the diff shows is judged")
    return f"diff applies to a clean workspace ({len(edits)} edit(s))"


def _each(name: str, requests: list[JudgeRequest], timed: Callable) -> list[Pair]:
    """Each request's output from `timed`, reported as a step of len(requests)."""
    out: list[Pair] = []
    with progress.step(name, len(requests)):
        for r in requests:
            out.append((r, timed(r)[0]))
            progress.advance()
    return out


def _has_plugins(workspace: str | Path | None) -> bool:
    return workspace is not None and any((Path(workspace) / "plugins").glob("*.py"))


def _next_gate(verdict: Verdict) -> str:
    return next((g for g in GATES if g not in verdict.gates), GATES[-1])
