"""The executors' shared vocabulary: a device (one timing slot), the executor protocol and its error. Kept
apart from the package's factory so that the executors import it without importing the factory that imports
them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from specpilot.core.deployment import Deployment
    from specpilot.core.recipe import Recipe
    from specpilot.core.workers import WorkerBase

EXECUTORS = ("local", "ray")


class ExecutorError(ValueError):
    """An executor that cannot be used as asked (unknown name, bad device, no Ray, no cluster); one line that
    says what to do."""


@dataclass(frozen=True)
class Device:
    """One timing slot. `name` is what the user sees (cuda:1, cpu:0-1, ray:0); `torch` the device the worker's
    engine loads on; `cpus` the cores a local worker is pinned to; `index` the slot's place in its executor."""

    name: str
    torch: str
    cpus: tuple[int, ...] | None = None
    index: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


class Executor(Protocol):
    """Starts workers on its devices. `start` launches one and returns at once (its `ready()` waits for the
    engine), so several can load at the same time; the worker is killed through `kill()`/`close()`."""

    name: str
    devices: list[Device]

    def start(self, deployment: "Deployment", recipe: "Recipe | None", workspace: str | Path | None,
              device: Device, limit_s: float, start_limit_s: float | None) -> "WorkerBase":
        ...

    def close(self) -> None:
        """Release what the executor holds (a Ray placement group, a cluster it started)."""
        ...
