"""The judge: evaluates a candidate recipe against the incumbent without ever running candidate code.

Candidates run in worker subprocesses (fresh interpreters, own process group, no API keys in their
environment) with a wall-clock limit per call; a worker that overruns is killed as a group. The judge
times each request from outside the worker, alternating incumbent and candidate request by request, and
runs token forcing itself on what the worker emitted. Gates run in order, cheapest first:
applies -> smoke -> forcing -> tuning -> heldout. One evaluation at a time per device.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from core.deployment import Deployment
from core.recipe import Recipe
from core.stats import Comparison, compare, noise_floor, speedups

_DEVICE_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
SECRET_ENV = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")


def device_lock(device: str) -> threading.Lock:
    """The single timing slot of a device: two measurements never share it."""
    with _LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(device, threading.Lock())


class WorkerError(RuntimeError):
    """A worker that crashed, refused, or answered nonsense."""


class WorkerTimeout(WorkerError):
    """A worker that overran its wall-clock limit (it has been killed)."""


@dataclass
class JudgeRequest:
    id: str
    index: int
    prompt: list[int]
    max_new_tokens: int


class Worker:
    """One resident engine in a subprocess, driven over pipes; replies arrive on a private descriptor."""

    def __init__(self, deployment: Deployment, recipe: Recipe | None, workspace: str | Path | None = None,
                 limit_s: float = 120.0) -> None:
        self.limit_s = limit_s
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "core.worker", str(write_fd)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=self.log, pass_fds=(write_fd,),
                                     start_new_session=True, env=env, text=True)
        os.close(write_fd)
        self.reply_fd = read_fd
        self.buffer = b""
        self.call({"op": "init", "deployment": deployment.to_dict(),
                   "recipe": recipe.to_toml() if recipe is not None else None,
                   "workspace": str(workspace) if workspace else None})

    def call(self, msg: dict, timeout: float | None = None) -> dict:
        """Send one request and wait for its reply, killing the worker if it overruns the limit."""
        deadline = time.monotonic() + (timeout or self.limit_s)
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(f"worker exited ({self._tail()})") from None
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerTimeout(f"worker exceeded its {timeout or self.limit_s:.0f} s limit and was killed")
            ready, _, _ = select.select([self.reply_fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.reply_fd, 1 << 16)
                if not chunk:
                    self.proc.wait(timeout=5)
                    raise WorkerError(f"worker died with exit code {self.proc.returncode} ({self._tail()})")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self.kill()
            raise WorkerError("worker sent a malformed reply") from None
        if not reply.get("ok"):
            raise WorkerError(str(reply.get("error", "unknown worker error")))
        return reply

    def timed(self, request: JudgeRequest) -> tuple[list[int], float]:
        """Generate one request; the time is measured here, around the whole round trip."""
        t0 = time.perf_counter()
        reply = self.call({"op": "generate", "prompt": request.prompt, "max_new_tokens": request.max_new_tokens,
                           "request_id": request.index})
        seconds = time.perf_counter() - t0
        tokens = reply.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WorkerError("worker returned tokens that are not a list of integers")
        return tokens, seconds

    def _tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "no output"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout=10)
            except WorkerError:
                pass
        self.kill()
        os.close(self.reply_fd)
        self.log.close()


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
GateHook = Callable[[str, bool, str], None]


class Judge:
    """Gates and timing for one deployment's tuning and held-out requests."""

    def __init__(self, deployment: Deployment, tuning: list[JudgeRequest], heldout: list[JudgeRequest],
                 force: Forcer, limit_s: float = 120.0, workspace: str | Path | None = None, seed: int = 0) -> None:
        self.deployment = deployment
        self.tuning = tuning
        self.heldout = heldout
        self.force = force
        self.limit_s = limit_s
        self.workspace = workspace
        self.seed = seed
        self.floor = 0.0
        self.stock_rate: float | None = None
        self.lock = device_lock(deployment.device)

    def worker(self, recipe: Recipe | None, workspace: bool = False) -> Worker:
        return Worker(self.deployment, recipe, self.workspace if workspace else None, self.limit_s)

    def calibrate(self, incumbent: Recipe, stock: Recipe) -> dict:
        """A/A noise floor (incumbent against itself) and stock's own forcing rate on the tuning set."""
        with self.lock:
            a, b = self.worker(incumbent), self.worker(incumbent)
            try:
                _, samples = self._ab(a, b, self.tuning)
            finally:
                a.close()
                b.close()
            ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
            self.floor = noise_floor(ratios, self.seed)
            w = self.worker(stock)
            try:
                outputs = [w.timed(r)[0] for r in self.tuning]
            finally:
                w.close()
            stock_forcing = self.force(self.tuning, outputs, stock)
            self.stock_rate = stock_forcing["rate"]
        return {"noise_floor": self.floor, "aa_samples": samples, "stock_forcing": stock_forcing}

    def _ab(self, incumbent: Worker, candidate: Worker, requests: list[JudgeRequest]) -> tuple[list[list[int]], list[dict]]:
        """Alternate incumbent and candidate request by request (A B, then B A, ...)."""
        outputs, samples = [], []
        for i, req in enumerate(requests):
            runs = {}
            for side in (("incumbent", "candidate") if i % 2 == 0 else ("candidate", "incumbent")):
                runs[side] = (incumbent if side == "incumbent" else candidate).timed(req)
            (inc_tokens, inc_s), (cand_tokens, cand_s) = runs["incumbent"], runs["candidate"]
            outputs.append(cand_tokens)
            samples.append({"request": req.id, "incumbent_s": inc_s, "candidate_s": cand_s,
                            "incumbent_tps": len(inc_tokens) / inc_s, "candidate_tps": len(cand_tokens) / cand_s})
        return outputs, samples

    def evaluate(self, recipe: Recipe, incumbent: Recipe, on_gate: GateHook | None = None,
                 on_forcing: Callable[[dict], None] | None = None,
                 on_evaluation: Callable[[str, Comparison], None] | None = None) -> Verdict:
        """Run the gates for `recipe` against `incumbent`; stops at the first failed gate."""
        verdict = Verdict()

        def gate(name: str, passed: bool, detail: str) -> bool:
            verdict.gates[name] = {"passed": passed, "detail": detail}
            if on_gate:
                on_gate(name, passed, detail)
            return passed

        gate("applies", True, "recipe validated")
        with self.lock:
            try:
                cand = self.worker(recipe, workspace=True)
            except WorkerError as exc:
                gate("smoke", False, f"worker failed to start: {exc}")
                return verdict
            inc = None
            try:
                probe = self.tuning[0]
                short = JudgeRequest(probe.id, probe.index, probe.prompt, min(8, probe.max_new_tokens))
                tokens, _ = cand.timed(short)
                if len(tokens) > short.max_new_tokens:
                    gate("smoke", False, f"emitted {len(tokens)} tokens for max_new_tokens {short.max_new_tokens}")
                    return verdict
                gate("smoke", True, f"{len(tokens)} tokens on a short request")
                outputs = [cand.timed(r)[0] for r in self.tuning]
                forcing = self.force(self.tuning, outputs, recipe)
                threshold = (self.stock_rate or 0.0) + 0.005
                forcing = {**forcing, "threshold": threshold, "passed": forcing["rate"] <= threshold}
                verdict.forcing = forcing
                if on_forcing:
                    on_forcing(forcing)
                if not gate("forcing", forcing["passed"], f"mismatch rate {forcing['rate']:.4f} vs threshold "
                                                           f"{threshold:.4f}"):
                    return verdict
                inc = self.worker(incumbent, workspace=True)
                for split, requests in (("tuning", self.tuning), ("heldout", self.heldout)):
                    _, samples = self._ab(inc, cand, requests)
                    verdict.samples[split] = samples
                    ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
                    result = compare(ratios, self.floor, self.seed)
                    setattr(verdict, split, result)
                    if on_evaluation:
                        on_evaluation(split, result)
                    if not gate(split, result.passed, f"speedup {result.speedup:.3f} [{result.low:.3f}, "
                                                      f"{result.high:.3f}] needs low > {1 + self.floor:.3f}"):
                        return verdict
            except WorkerTimeout as exc:
                gate(_next_gate(verdict), False, str(exc))
            except WorkerError as exc:
                gate(_next_gate(verdict), False, f"candidate crashed: {exc}")
            finally:
                cand.close()
                if inc is not None:
                    inc.close()
        return verdict

    def measure(self, baseline: Recipe | None, recipe: Recipe, requests: list[JudgeRequest]) -> Comparison:
        """Speedup of `recipe` over `baseline` (None = our autoregressive decoding) on `requests`."""
        with self.lock:
            a, b = self.worker(baseline, workspace=True), self.worker(recipe, workspace=True)
            try:
                _, samples = self._ab(a, b, requests)
            finally:
                a.close()
                b.close()
        ratios = speedups([s["incumbent_tps"] for s in samples], [s["candidate_tps"] for s in samples])
        return compare(ratios, self.floor, self.seed)


def _next_gate(verdict: Verdict) -> str:
    order = ("applies", "smoke", "forcing", "tuning", "heldout")
    return next(g for g in order if g not in verdict.gates)
