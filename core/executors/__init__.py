"""Executors: where the judge's workers run. The judge asks an executor for its devices (timing slots) and
starts, calls and kills workers through it; it never learns more about where they are.

A device is one timing slot: one A/B comparison runs entirely on it (incumbent and candidate alternating
request by request) and two measurements never share it. `local` runs subprocess workers on this machine's
devices (one by default, as given by --device; or several, `--devices cuda:0,cuda:1` or CPU core sets
`--devices cpu:0,cpu:1`); `ray` places the same workers, each inside a Ray actor, on the GPUs (or CPU
bundles) of a Ray cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specpilot.core.executors.base import EXECUTORS, Device, Executor, ExecutorError

if TYPE_CHECKING:
    from specpilot.core.deployment import Deployment

__all__ = ["EXECUTORS", "Device", "Executor", "ExecutorError", "check_executor", "make_executor"]


def check_executor(name: str) -> None:
    """Refuse an unknown executor name, or `ray` without Ray installed, before anything starts."""
    if name not in EXECUTORS:
        raise ExecutorError(f"--executor {name!r} is unknown; use one of: {', '.join(EXECUTORS)}")
    if name == "ray":
        from specpilot.core.executors.ray import require_ray  # lazily: Ray is an optional extra

        require_ray()


def make_executor(name: str, deployment: "Deployment", devices: str | None = None,
                  ray_address: str | None = None) -> Executor:
    """The executor `name` over `devices` (see the module docstring); ExecutorError on bad input."""
    check_executor(name)
    if name == "local":
        if ray_address:
            raise ExecutorError("--ray-address needs --executor ray")
        from specpilot.core.executors.local import LocalExecutor  # lazily: the workers' module loads torch

        return LocalExecutor(deployment, devices)
    from specpilot.core.executors.ray import RayExecutor  # lazily: Ray is an optional extra

    return RayExecutor(deployment, devices, ray_address)
