"""Executors: where the judge's workers run. The judge asks an executor for its devices (timing slots) and
starts, calls and kills workers through it; it never learns more about where they are.

A device is one timing slot: one A/B comparison runs entirely on it (incumbent and candidate alternating
request by request) and two measurements never share it. `local` runs subprocess workers on this machine's
devices (one by default, as given by --device; or several, `--devices cuda:0,cuda:1` or CPU core sets
`--devices cpu:0,cpu:1`); `ray` places the same workers, each inside a Ray actor, on the GPUs (or CPU
bundles) of a Ray cluster.
"""

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


def check_executor(name: str) -> None:
    """Refuse an unknown executor name, or `ray` without Ray installed, before anything starts."""
    if name not in EXECUTORS:
        raise ExecutorError(f"--executor {name!r} is unknown; use one of: {', '.join(EXECUTORS)}")
    if name == "ray":
        from specpilot.core.executors.ray import require_ray

        require_ray()


def make_executor(name: str, deployment: "Deployment", devices: str | None = None,
                  ray_address: str | None = None) -> Executor:
    """The executor `name` over `devices` (see the module docstring); ExecutorError on bad input."""
    check_executor(name)
    if name == "local":
        if ray_address:
            raise ExecutorError("--ray-address needs --executor ray")
        from specpilot.core.executors.local import LocalExecutor

        return LocalExecutor(deployment, devices)
    from specpilot.core.executors.ray import RayExecutor

    return RayExecutor(deployment, devices, ray_address)
