"""The worker protocol: one resident engine in a subprocess, driven over pipes, never trusted.

Candidate code only ever runs in a worker (a fresh interpreter in its own process group, no API keys in its
environment), never in the judge. Each call has a wall-clock limit (loading the engine a longer one); a
worker that overruns is killed as a group. Replies arrive on a private descriptor, so nothing a candidate
prints can forge one. Whoever drives a worker times each request from its own side of the call; a worker's
own stats and timings are never used. An executor (core/executors) decides where workers run; `WorkerBase`
is what the judge sees of any of them.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specpilot.core.deployment import Deployment
    from specpilot.core.recipe import Recipe

SECRET_ENV = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
KEEP = object()  # WorkerBase.timed: run the worker's own recipe
START_LIMIT_S = 300.0  # loading an engine (and importing the workspace's plugins) may take this long


class WorkerError(RuntimeError):
    """A worker that crashed, refused, or answered nonsense; `worker` is the one it came from."""

    worker: "WorkerBase | None" = None


class WorkerTimeout(WorkerError):
    """A worker that overran its wall-clock limit (it has been killed)."""


@dataclass
class JudgeRequest:
    id: str
    index: int
    prompt: list[int]
    max_new_tokens: int


_LIVE: "weakref.WeakSet[WorkerBase]" = weakref.WeakSet()  # every worker not yet killed, wherever it runs


def track(worker: "WorkerBase") -> None:
    """Count a started worker among the live ones `kill_workers` reaches, whichever executor started it."""
    _LIVE.add(worker)


def untrack(worker: "WorkerBase") -> None:
    """Forget a worker that is dead."""
    _LIVE.discard(worker)


def kill_workers() -> int:
    """Kill every live worker of this process (a quitting dashboard that cannot wait for the loop);
    returns how many there were."""
    live = list(_LIVE)
    for w in live:
        w.kill()
    return len(live)


def recipe_text(recipe: "Recipe | str | None") -> str | None:
    """A recipe as the worker protocol carries it: TOML text, or None for autoregressive decoding."""
    if recipe is None or isinstance(recipe, str):
        return recipe
    return recipe.to_toml()


def deployment_dict(deployment: "Deployment | dict") -> dict:
    return deployment if isinstance(deployment, dict) else deployment.to_dict()


class WorkerBase:
    """What the judge drives: `ready()`, `call()`, `kill()`, `close()`; timing and the token check are here,
    on the judge's side of every call, whatever carries the call (a pipe, a Ray actor)."""

    limit_s: float = 120.0

    def ready(self) -> "WorkerBase":
        raise NotImplementedError

    def call(self, msg: dict, timeout: float | None = None) -> dict:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def timed(self, request: JudgeRequest, recipe: "Recipe | None | object" = KEEP) -> tuple[list[int], float]:
        """Generate one request; the time is measured here, around the whole round trip. Only the tokens of
        the reply are used: whatever else a worker reports (stats, timings) is never trusted. `recipe`
        overrides the worker's own recipe for this request (None: autoregressive); the judge does that only
        on its baseline worker, which never loads candidate code."""
        msg: dict[str, Any] = {"op": "generate", "prompt": request.prompt, "max_new_tokens": request.max_new_tokens,
                               "request_id": request.index}
        if recipe is not KEEP:
            msg["recipe"] = recipe_text(recipe)  # type: ignore[arg-type]
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


class Worker(WorkerBase):
    """One resident engine in a local subprocess, driven over pipes; replies arrive on a private descriptor.

    `start=False` only launches the process and sends `init`; call `ready()` to wait for it, so several
    workers can load their engines at once (nothing is timed while any of them starts). `deployment` may be
    a Deployment or its dict, `recipe` a Recipe or its TOML (what a Ray actor receives).
    """

    MAX_REPLY = 64 << 20  # a reply line longer than this is nonsense (a flooding candidate), not a reply

    def __init__(self, deployment: "Deployment | dict", recipe: "Recipe | str | None",
                 workspace: str | Path | None = None, limit_s: float = 120.0, start: bool = True,
                 start_limit_s: float | None = None, cpus: list[int] | None = None) -> None:
        self.limit_s = limit_s
        self.start_limit_s = start_limit_s if start_limit_s is not None else max(limit_s, START_LIMIT_S)
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.pop("SPECPILOT_WORKER_CPUS", None)
        if cpus:
            env["SPECPILOT_WORKER_CPUS"] = ",".join(map(str, cpus))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "specpilot.core.worker_process", str(write_fd)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.log,
                                     pass_fds=(write_fd,), start_new_session=True, env=env, text=True)
        os.close(write_fd)
        track(self)
        self.reply_fd = read_fd
        self.buffer = b""
        self._closed = False
        self._starting = True
        self._send({"op": "init", "deployment": deployment_dict(deployment), "recipe": recipe_text(recipe),
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
        untrack(self)

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

    def __init__(self, worker: WorkerBase, recipe: "Recipe | None") -> None:
        self.worker = worker
        self.recipe = recipe

    def timed(self, request: JudgeRequest) -> tuple[list[int], float]:
        return self.worker.timed(request, self.recipe)

    def warm_up(self, request: JudgeRequest) -> None:
        self.worker.timed(request, self.recipe)

    def close(self) -> None:
        """The baseline stays resident for the judge's next measurement."""
