"""Progress of long steps (requests done of total, elapsed, ETA), reported from deep inside the core.

The loop installs a reporter in its own thread; code that loops over requests (the judge's timed runs,
the cost model's passes) calls `step()` and `advance()` without knowing who listens, so no signature
changes ripple through the core. The reporter may also cancel the step: `advance()` raises Cancelled when
the run was asked to stop, which is how quitting ends a measurement promptly instead of after it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar


class Cancelled(Exception):
    """The step in flight was abandoned because the run is stopping; nothing half-done is kept."""


@dataclass
class Step:
    """One long step as the user sees it: what, how far, since when."""

    name: str
    total: int | None
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def eta(self) -> float | None:
        """Seconds left at the pace so far (None before the first request is done)."""
        if not self.total or self.done <= 0:
            return None
        return self.elapsed / self.done * max(0, self.total - self.done)

    def payload(self) -> dict:
        return {"step": self.name, "done": self.done, "total": self.total, "elapsed_s": round(self.elapsed, 1),
                "eta_s": None if self.eta is None else round(self.eta, 1)}


Report = Callable[[Step], None]
T = TypeVar("T")
_local = threading.local()


@contextmanager
def reporting(report: Report, cancelled: Callable[[], bool]) -> Iterator[None]:
    """Send this thread's steps to `report`; `cancelled()` true makes the next `advance` raise Cancelled."""
    _local.report, _local.cancelled, _local.stack = report, cancelled, []
    try:
        yield
    finally:
        _local.report = _local.cancelled = None
        _local.stack = []


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, to run in another thread as if in this one: its steps go to this thread's reporter and it
    obeys this thread's cancellation (the judge's evaluations on several devices at once)."""
    report, cancelled = getattr(_local, "report", None), getattr(_local, "cancelled", None)

    def run(*args: object, **kwargs: object) -> T:
        if report is None or getattr(_local, "report", None) is report:
            return fn(*args, **kwargs)
        with reporting(report, cancelled):
            return fn(*args, **kwargs)

    return run


def _emit(current: Step) -> None:
    report = getattr(_local, "report", None)
    if report is not None:
        report(current)


def check() -> None:
    """Raise Cancelled if this thread's run is stopping (a no-op where nobody reports)."""
    cancelled = getattr(_local, "cancelled", None)
    if cancelled is not None and cancelled():
        raise Cancelled("the run is stopping")


@contextmanager
def step(name: str, total: int | None = None) -> Iterator[Step]:
    """A named long step of `total` units; nested steps show as 'outer: inner' and restore the outer."""
    stack: list[Step] = getattr(_local, "stack", None) or []
    full = f"{stack[-1].name}: {name}" if stack else name
    current = Step(full, total)
    stack.append(current)
    _local.stack = stack
    check()
    _emit(current)
    try:
        yield current
    finally:
        stack.pop()


def advance(n: int = 1) -> None:
    """One more unit of the innermost step is done; raises Cancelled if the run is stopping."""
    stack: list[Step] = getattr(_local, "stack", None) or []
    if stack:
        stack[-1].done += n
        _emit(stack[-1])
    check()


def clock(seconds: float) -> str:
    """Seconds as a person reads a duration: 42s, 3m05s, 1h02m."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def describe(p: dict) -> str:
    """A `progress` payload in words: 'calibration: A/A noise floor: 12/40 requests, 1m02s, ETA 3m10s'."""
    done, total = p.get("done") or 0, p.get("total")
    count = f" {done}/{total} requests" if total else ""
    eta = p.get("eta_s")
    tail = f", ETA {clock(eta)}" if eta is not None and total and done < total else ""
    return f"{p.get('step', '')}{count}, {clock(p.get('elapsed_s') or 0)}{tail}"
