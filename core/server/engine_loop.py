"""The engine thread: the one place the scheduler runs, fed by the HTTP layer through a queue.

HTTP handlers never touch the scheduler. They `submit` a job (refused with 429 when the bounded queue is
full, so memory never grows with load) and read its tokens from an asyncio queue the engine thread fills
through the event loop's thread-safe call; `cancel` aborts a job between steps and frees its row. The engine
thread alone adds, steps and aborts, so the scheduler needs no lock, and a request's tokens do not depend on
what else is in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from specpilot.core.engine.decode import PHASES, GenerationError, StepStats
from specpilot.core.engine.scheduler import Event, Scheduler
from specpilot.core.server.metrics import Metrics
from specpilot.core.server.protocol import ApiError, Job

log = logging.getLogger("specpilot.serve")

SHUTDOWN = "the server is shutting down and this request did not finish within its grace period"
UNAVAILABLE = "unavailable"  # the finish of a queued request turned away by a draining server (HTTP 503)


class EngineLoop:
    """Runs `scheduler` on a daemon thread; `capacity` bounds the jobs accepted and not yet ended."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, max_queue: int,
                 on_error: Callable[[str], None] = lambda line: None) -> None:
        self.sched, self.metrics, self.on_error = scheduler, metrics, on_error
        self.capacity = scheduler.max_batch + max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.outstanding = 0
        self.jobs: dict[int, Job] = {}  # engine id -> job, touched by the engine thread only
        self.last: dict[int, float] = {}  # engine id -> when its previous tokens came
        self.thread = threading.Thread(target=self._run, name="specpilot-engine", daemon=True)
        scheduler.on_step = self._observe  # a server runs for days: steps go to the metrics, no history is kept
        if scheduler.kv_budget is not None:
            metrics.kv_budget.set(scheduler.kv_budget)
        metrics.kv_resident.set_function(self._resident)
        self._prefix_seen = (0, 0)
        self.failure: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job for the engine, or refuse it with 429 and Retry-After when the queue is full."""
        with self.lock:
            if self.outstanding >= self.capacity:
                raise ApiError(429, f"the server has {self.outstanding} requests in flight or queued (its limit is "
                               f"{self.capacity}); retry shortly", kind="rate_limit_exceeded",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.outstanding += 1
        self.inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        """Abort a job (a client gone, a stop string met); its row is free before the next step."""
        self.inbox.put(("abort", job))

    def abort_all(self, why: str = SHUTDOWN) -> None:
        self.inbox.put(("abort_all", why))

    def turn_away_queued(self, why: str) -> None:
        """End every request accepted but not yet running (a server that drains finishes only those in flight);
        their handlers answer 503 with `why`."""
        self.inbox.put(("turn_away_queued", why))

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def _end(self, job: Job, finish: str | None, error: str | None = None, last: Event | None = None) -> None:
        """Retire a job; unless it was aborted, its handler gets the finishing event (`last`, the scheduler's
        own, or an empty one carrying `finish` and `error`)."""
        if job.done:
            return
        job.done = True
        if job.engine_id is not None:
            self.jobs.pop(job.engine_id, None)
            self.last.pop(job.engine_id, None)
        with self.lock:
            self.outstanding -= 1
        self.metrics.finished.labels(finish or "abort").inc()
        if finish is not None:
            self._deliver(job, last or Event(-1 if job.engine_id is None else job.engine_id, [], finish, error))

    @staticmethod
    def _deliver(job: Job, event: Event) -> None:
        """Hand the scheduler's event to the job's HTTP handler, as itself, on the handler's event loop."""
        if job.loop is None or job.events is None:
            return
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the HTTP loop has closed: nobody is listening any more
            pass

    def _command(self, cmd: str, arg) -> bool:
        """Apply one inbox command; False on stop."""
        if cmd == "add":
            job: Job = arg
            try:
                job.engine_id = self.sched.add(job.prompt, job.max_tokens, job.seed_id, job.ver)
            except GenerationError as exc:
                self._end(job, "error", str(exc))
                return True
            self.jobs[job.engine_id] = job
            self.metrics.prompt_tokens.inc(len(job.prompt))
        elif cmd == "abort":
            job = arg
            if not job.done and job.engine_id is not None:
                self.sched.abort(job.engine_id)
                self._end(job, None)
        elif cmd == "abort_all":
            for job in list(self.jobs.values()):
                self.sched.abort(job.engine_id)
                self._end(job, "error", arg)
        elif cmd == "turn_away_queued":
            for job in [j for j in self.jobs.values() if self.sched.is_queued(j.engine_id)]:
                self.sched.abort(job.engine_id)
                self._end(job, UNAVAILABLE, arg)
        elif cmd == "stop":
            return False
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the engine itself broke: fail every job rather than hang its client
            self.failure = exc
            self.on_error(f"engine thread stopped: {type(exc).__name__}: {exc}")
            for job in list(self.jobs.values()):
                self._end(job, "error", f"the engine stopped: {exc}")

    def _loop(self) -> None:
        while True:
            try:
                cmd, arg = self.inbox.get(timeout=0.2) if self.sched.idle() else self.inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if not self._command(cmd, arg):
                    return
                try:
                    cmd, arg = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.sched.idle():
                self._step()
                self._count_prefix()
            self.metrics.queue.set(self.sched.waiting)
            self.metrics.running.set(self.sched.in_flight)
            self.metrics.kv_reserved.set(self.sched.reserved)

    def _observe(self, stats: StepStats) -> None:
        for gained in stats.accepted:
            self.metrics.accepted.observe(gained)
        self.metrics.step_drafted.observe(stats.nodes - len(stats.accepted))
        self.metrics.step_accepted.observe(sum(stats.accepted) - len(stats.accepted))
        self.metrics.step_prefilled.observe(stats.prefilled)
        self.metrics.step_rows.observe(len(stats.accepted))
        self.metrics.step_drafting.observe(stats.drafting)
        for phase in PHASES:
            self.metrics.step_seconds.labels(phase).inc(getattr(stats, f"{phase}_ms") / 1e3)
        self.metrics.catch_up_tokens.inc(stats.caught_up)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step: %d rows, %d drafting, %d drafted, %d accepted, %d caught up, %d prefilled, %d waiting; "
                      "ms %s", len(stats.accepted), stats.drafting, stats.nodes - len(stats.accepted),
                      sum(stats.accepted) - len(stats.accepted), stats.caught_up, stats.prefilled, self.sched.waiting,
                      " ".join(f"{p} {getattr(stats, p + '_ms'):.0f}" for p in PHASES))

    def _resident(self) -> float:
        """The caches' measured memory, read when /metrics is scraped (the caches' mappings only, never resized)."""
        caches = [self.sched.cache, getattr(self.sched.drafter, "cache", None)]
        return float(sum(c.resident_bytes() for c in caches if c is not None))

    def _count_prefix(self) -> None:
        prefix = self.sched.prefix
        if prefix is None:
            return
        queries, hits = prefix.stats.queries, prefix.stats.hits
        self.metrics.prefix_queries.inc(queries - self._prefix_seen[0])
        self.metrics.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)

    def _step(self) -> None:
        events = self.sched.step()
        now = time.perf_counter()
        for ev in events:
            job = self.jobs.get(ev.id)
            if job is None:
                continue
            if ev.error:
                self.on_error(f"request {job.rid} failed in the engine: {ev.error}")
                self._end(job, "error", ev.error)
                continue
            if ev.tokens:
                self.metrics.generation_tokens.inc(len(ev.tokens))
                before = self.last.get(ev.id)
                if before is None:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    for _ in ev.tokens:
                        self.metrics.itl.observe((now - before) / len(ev.tokens))
                self.last[ev.id] = now
            if ev.finish:
                self._end(job, ev.finish, last=ev)
            else:
                self._deliver(job, ev)
