"""The judge: evaluates a candidate recipe against the incumbent without ever running candidate code.

Candidates run in worker subprocesses (fresh interpreters, own process group, no API keys in their
environment) with a wall-clock limit per call (and a longer one for loading the engine); a worker that
overruns is killed as a group. Trusted recipes (stock, autoregressive decoding, an incumbent without plugin
code) run on one resident baseline worker that never loads a workspace. The judge times each request from
outside the worker, alternating incumbent and candidate request by request (each request once: a candidate
never sees a held-out prompt before it is timed), and runs token forcing itself on everything a candidate
emitted, timed runs included: a worker's own stats and timings are never used. Gates run in order,
cheapest first: applies -> smoke -> forcing -> tuning -> heldout. One evaluation at a time per device; on
a CPU device every worker is pinned to the same cores.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from core import progress
from core.deployment import Deployment
from core.events import GATES
from core.mechanisms import UnknownMechanism, check_recipe
from core.recipe import Recipe
from core.stats import Comparison, compare, noise_floor, speedups

_DEVICE_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
SECRET_ENV = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
KEEP = object()  # Worker.timed: run the worker's own recipe
START_LIMIT_S = 300.0  # loading an engine (and importing the workspace's plugins) may take this long


def timing_cpus(deployment: Deployment) -> list[int] | None:
    """On a CPU deployment every worker runs on the same cores (as many as its torch threads), so both
    sides of an A/B share them, and whatever else the machine runs, alike; without pinning, one side can
    sit on a busier core for a whole comparison (measured on this 2-core machine under load: A/A noise
    floors up to 0.75 unpinned, under 0.1 pinned). Other devices are left alone."""
    if not deployment.device.startswith("cpu") or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-max(1, deployment.threads or 1):]


def device_lock(device: str) -> threading.Lock:
    """The single timing slot of a device: two measurements never share it."""
    with _LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(device, threading.Lock())


class WorkerError(RuntimeError):
    """A worker that crashed, refused, or answered nonsense; `worker` is the one it came from."""

    worker: "Worker | None" = None


class WorkerTimeout(WorkerError):
    """A worker that overran its wall-clock limit (it has been killed)."""


@dataclass
class JudgeRequest:
    id: str
    index: int
    prompt: list[int]
    max_new_tokens: int


_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()  # every worker process not yet killed


def kill_workers() -> int:
    """Kill every live worker of this process (a quitting dashboard that cannot wait for the loop);
    returns how many there were."""
    live = list(_LIVE)
    for w in live:
        w.kill()
    return len(live)


class Worker:
    """One resident engine in a subprocess, driven over pipes; replies arrive on a private descriptor.

    `start=False` only launches the process and sends `init`; call `ready()` to wait for it, so several
    workers can load their engines at once (nothing is timed while any of them starts).
    """

    MAX_REPLY = 64 << 20  # a reply line longer than this is nonsense (a flooding candidate), not a reply

    def __init__(self, deployment: Deployment, recipe: Recipe | None, workspace: str | Path | None = None,
                 limit_s: float = 120.0, start: bool = True, start_limit_s: float | None = None,
                 cpus: list[int] | None = None) -> None:
        self.limit_s = limit_s
        self.start_limit_s = start_limit_s if start_limit_s is not None else max(limit_s, START_LIMIT_S)
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.pop("SPECPILOT_WORKER_CPUS", None)
        if cpus:
            env["SPECPILOT_WORKER_CPUS"] = ",".join(map(str, cpus))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "core.worker", str(write_fd)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=self.log, pass_fds=(write_fd,),
                                     start_new_session=True, env=env, text=True)
        os.close(write_fd)
        _LIVE.add(self)
        self.reply_fd = read_fd
        self.buffer = b""
        self._closed = False
        self._starting = True
        self._send({"op": "init", "deployment": deployment.to_dict(),
                    "recipe": recipe.to_toml() if recipe is not None else None,
                    "workspace": str(workspace) if workspace else None})
        if start:
            self.ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> "Worker":
        """Wait for the engine to load; a worker that fails to start is killed before the error is raised."""
        try:
            self._receive(self.start_limit_s)
        except WorkerError:
            self.close()
            raise
        self._starting = False
        return self

    def call(self, msg: dict, timeout: float | None = None) -> dict:
        """Send one request and wait for its reply, killing the worker if it overruns the limit."""
        try:
            self._send(msg)
            return self._receive(timeout or self.limit_s)
        except WorkerError as exc:
            exc.worker = self
            raise

    def _send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.kill()
            raise WorkerError(f"worker exited ({self._tail()})") from None

    def _receive(self, limit: float) -> dict:
        deadline = time.monotonic() + limit
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerTimeout(f"worker exceeded its {limit:.0f} s limit and was killed")
            ready, _, _ = select.select([self.reply_fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.reply_fd, 1 << 16)
                if not chunk:
                    self.kill()
                    raise WorkerError(f"worker died with exit code {self.proc.returncode} ({self._tail()})")
                self.buffer += chunk
                if len(self.buffer) > self.MAX_REPLY:
                    self.kill()
                    raise WorkerError(f"worker sent more than {self.MAX_REPLY >> 20} MiB without a reply line")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.kill()
            raise WorkerError("worker sent a malformed reply") from None
        if not isinstance(reply, dict):
            self.kill()
            raise WorkerError("worker sent a malformed reply") from None
        if not reply.get("ok"):
            raise WorkerError(str(reply.get("error", "unknown worker error"))[:500])
        return reply

    def timed(self, request: JudgeRequest, recipe: Recipe | None | object = KEEP) -> tuple[list[int], float]:
        """Generate one request; the time is measured here, around the whole round trip. Only the tokens of
        the reply are used: whatever else a worker reports (stats, timings) is never trusted. `recipe`
        overrides the worker's own recipe for this request (None: autoregressive); the judge does that only
        on its baseline worker, which never loads candidate code."""
        msg = {"op": "generate", "prompt": request.prompt, "max_new_tokens": request.max_new_tokens,
               "request_id": request.index}
        if recipe is not KEEP:
            msg["recipe"] = recipe.to_toml() if isinstance(recipe, Recipe) else None
        t0 = time.perf_counter()
        reply = self.call(msg)
        seconds = time.perf_counter() - t0
        tokens = reply.get("tokens")
        if (not isinstance(tokens, list) or len(tokens) > 4 * request.max_new_tokens + 64
                or not all(type(t) is int and t >= 0 for t in tokens)):
            exc = WorkerError("worker returned tokens that are not a list of token ids")
            exc.worker = self
            raise exc
        return tokens, seconds

    def warm_up(self, request: JudgeRequest) -> None:
        """One untimed request right before timing starts, so first-call costs (allocations, lazy init, a
        process gone cold while the judge did other work) are never timed."""
        self.timed(request)

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.returncode is None

    def _tail(self) -> str:
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return "no output"
        return lines[-1][:300] if lines else "no output"

    def kill(self) -> None:
        """Kill the worker's whole process group (whatever it spawned too), then reap it. The group is
        signalled before the worker is reaped, so its id cannot have been reused by another process."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _LIVE.discard(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.returncode is None and not self._starting:
            try:
                self.call({"op": "exit"}, timeout=10)
            except WorkerError:
                pass
        self.kill()
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        os.close(self.reply_fd)
        self.log.close()


class Bound:
    """The judge's baseline worker running one trusted recipe (None: our autoregressive decoding)."""

    def __init__(self, worker: Worker, recipe: Recipe | None) -> None:
        self.worker = worker
        self.recipe = recipe

    def timed(self, request: JudgeRequest) -> tuple[list[int], float]:
        return self.worker.timed(request, self.recipe)

    def warm_up(self, request: JudgeRequest) -> None:
        self.worker.timed(request, self.recipe)

    def close(self) -> None:
        """The baseline stays resident for the judge's next measurement."""


@dataclass
class Verdict:
    gates: dict[str, dict] = field(default_factory=dict)
    forcing: dict | None = None
    tuning: Comparison | None = None
    heldout: Comparison | None = None
    samples: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(g["passed"] for g in self.gates.values()) and "heldout" in self.gates

    @property
    def reason(self) -> str:
        failed = next((f"{name}: {g['detail']}" for name, g in self.gates.items() if not g["passed"]), None)
        return failed or "passed every gate"


Forcer = Callable[[list[JudgeRequest], list[list[int]], Recipe], dict]
Pair = tuple[JudgeRequest, list[int]]  # a request and one output a worker emitted for it
GateHook = Callable[[str, bool, str], None]


class Judge:
    """Gates and timing for one deployment's tuning and held-out requests.

    Trusted recipes (stock, autoregressive decoding, an incumbent without plugin code) run on one resident
    baseline worker that never loads a workspace; every candidate, and any incumbent with plugin code, gets
    a fresh worker of its own. `close()` ends the baseline worker."""

    def __init__(self, deployment: Deployment, tuning: list[JudgeRequest], heldout: list[JudgeRequest],
                 force: Forcer, limit_s: float = 120.0, seed: int = 0, start_limit_s: float | None = None) -> None:
        self.deployment = deployment
        self.tuning = tuning
        self.heldout = heldout
        self.force = force
        self.limit_s = limit_s
        self.start_limit_s = start_limit_s
        self.seed = seed
        self.floor = 0.0
        self.stock_rate: float | None = None
        self.lock = device_lock(deployment.device)
        self.cpus = timing_cpus(deployment)
        self._baseline: Worker | None = None

    def worker(self, recipe: Recipe | None, workspace: str | Path | None = None, start: bool = True) -> Worker:
        return Worker(self.deployment, recipe, workspace, self.limit_s, start, self.start_limit_s, self.cpus)

    def _start(self, specs: list[tuple[Recipe | None, str | Path | None]], baseline: bool = False) -> list[Worker]:
        """Start fresh workers (and the baseline worker, if asked and not running) at once: their engines load
        in parallel, before anything is timed. All of them are ready on return, or none is left running."""
        started: list[Worker] = []
        try:
            if baseline and (self._baseline is None or not self._baseline.alive):
                self._baseline = self.worker(None, None, start=False)
                started.append(self._baseline)
            fresh = [self.worker(recipe, workspace, start=False) for recipe, workspace in specs]
            started += fresh
            for w in started:
                w.ready()
        except BaseException:
            for w in started:
                w.close()
            raise
        return fresh

    def _bound(self, recipe: Recipe | None) -> Bound:
        assert self._baseline is not None
        return Bound(self._baseline, recipe)

    def close(self) -> None:
        """End the resident baseline worker (a later measurement starts a new one)."""
        if self._baseline is not None:
            self._baseline.close()
            self._baseline = None

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def threshold(self) -> float:
        """The forcing threshold: stock's own mismatch rate in this run + 0.5 percentage points."""
        return (self.stock_rate or 0.0) + 0.005

    def calibrate(self, incumbent: Recipe, stock: Recipe, versus_ar: list[JudgeRequest] | None = None) -> dict:
        """A/A noise floor (the incumbent on the baseline worker against the incumbent on a fresh worker, as
        candidates are measured) and stock's own forcing rate on the tuning set; with `versus_ar`, also the
        incumbent's speedup over our autoregressive decoding on those requests."""
        same = incumbent.to_toml() == stock.to_toml()
        with self.lock:
            (fresh,) = self._start([(incumbent, None)], baseline=True)
            try:
                with progress.step("A/A noise floor"):
                    _, samples = self._ab(self._bound(incumbent), fresh, self.tuning)
                ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
                self.floor = noise_floor(ratios, self.seed)
                stock_side = fresh if same else self._bound(stock)
                stock_outputs = _each("stock outputs for forcing", self.tuning, stock_side.timed)
                vs_ar = None
                if versus_ar:
                    with progress.step("stock vs AR"):
                        _, ar_samples = self._ab(self._bound(None), fresh, versus_ar)
                    vs_ar = compare(speedups([s["incumbent_tps"] for s in ar_samples],
                                             [s["candidate_tps"] for s in ar_samples]), self.floor, self.seed)
            finally:
                fresh.close()
            stock_forcing = self.force([r for r, _ in stock_outputs], [t for _, t in stock_outputs], stock)
            self.stock_rate = stock_forcing["rate"]
        return {"noise_floor": self.floor, "aa_samples": samples, "stock_forcing": stock_forcing,
                "incumbent_vs_ar": vs_ar}

    def _rotate(self, workers: list[Worker | Bound], requests: list[JudgeRequest],
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

    def _ab(self, incumbent: Worker | Bound, candidate: Worker | Bound,
            requests: list[JudgeRequest]) -> tuple[list[Pair], list[dict]]:
        """Incumbent against candidate, request by request: the candidate's outputs and the paired samples."""
        (inc, cand), (_, outputs) = self._rotate([incumbent, candidate], requests)
        samples = [{"request": req.id, "incumbent_s": a["seconds"], "candidate_s": b["seconds"],
                    "incumbent_tps": a["tps"], "candidate_tps": b["tps"]}
                   for req, a, b in zip(requests, inc, cand)]
        return outputs, samples

    def _forced(self, outputs: list[Pair], recipe: Recipe) -> dict:
        """The judge's own token forcing of a candidate's outputs; outputs it cannot even score fail."""
        requests = [r for r, _ in outputs]
        try:
            result = dict(self.force(requests, [t for _, t in outputs], recipe))
        except Exception as exc:  # e.g. token ids outside the vocabulary, or a rule forcing cannot check
            return {"tokens": sum(r.max_new_tokens for r in requests), "mismatches": None, "rate": 1.0,
                    "near_ties": None, "threshold": self.threshold, "passed": False,
                    "error": f"forcing could not score the outputs: {type(exc).__name__}: {exc}"[:500]}
        return {**result, "threshold": self.threshold, "passed": result["rate"] <= self.threshold}

    def evaluate(self, recipe: Recipe, incumbent: Recipe, workspace: str | Path | None = None,
                 incumbent_workspace: str | Path | None = None, on_gate: GateHook | None = None,
                 on_forcing: Callable[[dict], None] | None = None,
                 on_evaluation: Callable[[str, Comparison], None] | None = None) -> Verdict:
        """Run the gates for `recipe` against `incumbent`; stops at the first failed gate.

        Only the judge's own measurements decide: its timings around each round trip and its own forcing
        of every output the candidate emitted (the forcing run and the timed runs alike)."""
        verdict = Verdict()

        def gate(name: str, passed: bool, detail: str) -> bool:
            verdict.gates[name] = {"passed": passed, "detail": detail}
            if on_gate:
                on_gate(name, passed, detail)
            return passed

        try:
            check_recipe(recipe, workspace)
        except UnknownMechanism as exc:
            gate("applies", False, str(exc))
            return verdict
        gate("applies", True, "recipe validated")
        own_worker = _has_plugins(incumbent_workspace)  # plugin code never enters the baseline worker
        with self.lock:
            cand = inc = None
            try:
                try:
                    if not own_worker and (self._baseline is None or not self._baseline.alive):
                        self._start([], baseline=True)
                except WorkerError as exc:
                    gate("smoke", False, f"the judge's baseline worker failed to start, so nothing could be "
                                         f"judged: {exc}")
                    return verdict
                try:
                    cand = self.worker(recipe, workspace, start=False)
                    if own_worker:
                        inc = self.worker(incumbent, incumbent_workspace, start=False)
                    cand.ready()
                except WorkerError as exc:
                    gate("smoke", False, f"worker failed to start: {exc}")
                    return verdict
                probe = self.tuning[0]
                short = JudgeRequest(probe.id, probe.index, probe.prompt, min(8, probe.max_new_tokens))
                tokens, _ = cand.timed(short)
                if len(tokens) > short.max_new_tokens:
                    gate("smoke", False, f"emitted {len(tokens)} tokens for max_new_tokens {short.max_new_tokens}")
                    return verdict
                gate("smoke", True, f"{len(tokens)} tokens on a short request")
                outputs = _each("outputs for token forcing", self.tuning, cand.timed)
                forcing = self._forced(outputs, recipe)
                verdict.forcing = forcing
                if on_forcing:
                    on_forcing(forcing)
                if not gate("forcing", forcing["passed"], forcing.get("error") or
                            f"mismatch rate {forcing['rate']:.4f} vs threshold {forcing['threshold']:.4f}"):
                    return verdict
                if inc is not None:
                    try:
                        inc.ready()
                    except WorkerError as exc:
                        gate("tuning", False, f"the incumbent's worker failed to start, so nothing could be timed: "
                                              f"{exc}")
                        return verdict
                incumbent_side = inc if inc is not None else self._bound(incumbent)
                for split, requests in (("tuning", self.tuning), ("heldout", self.heldout)):
                    with progress.step(f"{split} A/B"):
                        timed_outputs, samples = self._ab(incumbent_side, cand, requests)
                    verdict.samples[split] = samples
                    check = self._forced(timed_outputs, recipe)
                    if not check["passed"]:
                        why = check.get("error") or (f"mismatch rate {check['rate']:.4f} vs threshold "
                                                     f"{check['threshold']:.4f}")
                        gate(split, False, f"the outputs timed on {split} requests fail token forcing ({why})")
                        return verdict
                    ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
                    result = compare(ratios, self.floor, self.seed)
                    setattr(verdict, split, result)
                    if on_evaluation:
                        on_evaluation(split, result)
                    if not gate(split, result.passed, f"speedup {result.speedup:.3f}x [{result.low:.3f}, "
                                                      f"{result.high:.3f}] needs low > {1 + self.floor:.3f} "
                                                      f"(1 + noise floor {self.floor:.3f})"):
                        return verdict
            except WorkerError as exc:
                if exc.worker is not None and exc.worker is not cand:  # the incumbent's side, not the candidate
                    gate(_next_gate(verdict), False, f"the incumbent's worker failed, so the candidate could not "
                                                     f"be judged: {exc}")
                elif isinstance(exc, WorkerTimeout):
                    gate(_next_gate(verdict), False, str(exc))
                else:
                    gate(_next_gate(verdict), False, f"candidate crashed: {exc}")
            finally:
                for w in (cand, inc):
                    if w is not None:
                        w.close()
        return verdict

    def measure(self, baseline: Recipe | None, recipe: Recipe, requests: list[JudgeRequest],
                workspace: str | Path | None = None) -> Comparison:
        """Speedup of `recipe` (on a fresh worker with `workspace`) over `baseline` (None = our autoregressive
        decoding; on the baseline worker, which never loads a workspace: a plugin cannot slow its baseline)."""
        with self.lock:
            (fresh,) = self._start([(recipe, workspace)], baseline=True)
            try:
                _, samples = self._ab(self._bound(baseline), fresh, requests)
            finally:
                fresh.close()
        ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
        return compare(ratios, self.floor, self.seed)

    def standing(self, recipe: Recipe, stock: Recipe, requests: list[JudgeRequest],
                 workspace: str | Path | None = None) -> tuple[Comparison, Comparison]:
        """(speedup over our autoregressive decoding, speedup over stock) of an approved `recipe` on
        `requests`, timed in rotation: AR and stock on the baseline worker, and `recipe` too unless it
        comes with plugin code (then on a fresh worker with `workspace`)."""
        with self.lock:
            own = _has_plugins(workspace)
            fresh = self._start([(recipe, workspace)] if own else [], baseline=True)
            try:
                sides = [self._bound(None), self._bound(stock), fresh[0] if own else self._bound(recipe)]
                (ar, base, new), _ = self._rotate(sides, requests)
            finally:
                for w in fresh:
                    w.close()
        rates = [[s["tps"] for s in side] for side in (ar, base, new)]
        return (compare(speedups(rates[0], rates[2]), self.floor, self.seed),
                compare(speedups(rates[1], rates[2]), self.floor, self.seed))


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
