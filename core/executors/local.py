"""The local executor: subprocess workers on this machine's devices, one timing slot per device.

Without --devices there is one slot, the deployment's device (today's judge). `--devices cuda:0,cuda:1`
gives a slot per GPU; `--devices cpu:0,cpu:1` (or core ranges, `cpu:0-3,cpu:4-7`) a slot per CPU core set,
every worker of a slot pinned to its cores, so candidates are judged in parallel, each A/B on its own slot.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from specpilot.core.deployment import Deployment
from specpilot.core.executors.base import Device, ExecutorError
from specpilot.core.recipe import Recipe
from specpilot.core.workers import Worker

_DEVICE_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def device_lock(device: str) -> threading.Lock:
    """The single timing slot of a device in this process: two measurements never share it, whichever
    judge asks."""
    with _LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(device, threading.Lock())


def timing_cpus(deployment: Deployment) -> list[int] | None:
    """On a CPU deployment every worker runs on the same cores (as many as its torch threads), so both
    sides of an A/B share them, and whatever else the machine runs, alike; without pinning, one side can
    sit on a busier core for a whole comparison (measured on this 2-core machine under load: A/A noise
    floors up to 0.75 unpinned, under 0.1 pinned). Other devices are left alone."""
    if not deployment.device.startswith("cpu") or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-max(1, deployment.threads or 1):]


def _cores(spec: str, allowed: set[int]) -> tuple[int, ...]:
    """`3` or `0-3` as core ids, each one this process may run on."""
    try:
        lo, _, hi = spec.partition("-")
        cores = tuple(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        cores = ()
    if not cores:
        raise ExecutorError(f"--devices cpu:{spec}: expected a core or a range of cores, e.g. cpu:0 or cpu:0-3")
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise ExecutorError(f"--devices cpu:{spec}: core {missing[0]} is not available here (cores "
                            f"{','.join(map(str, sorted(allowed)))}); name cores this machine has")
    return cores


def parse_devices(spec: str | None, deployment: Deployment) -> list[Device]:
    """--devices as timing slots; None: the deployment's own device (pinned as `timing_cpus` says)."""
    if not spec:
        cpus = timing_cpus(deployment)
        name = deployment.device
        return [Device(name, name, tuple(cpus) if cpus else None, 0, device_lock(name))]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(names)) != len(names):
        raise ExecutorError(f"--devices {spec}: a device is named twice; each device is one timing slot")
    kind = deployment.device.split(":")[0]
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    devices: list[Device] = []
    for i, name in enumerate(names):
        base, _, rest = name.partition(":")
        if base not in ("cpu", "cuda"):
            raise ExecutorError(f"--devices {name}: expected cuda:N or cpu:CORES (e.g. cuda:0,cuda:1 or cpu:0,cpu:1)")
        if base != kind:
            raise ExecutorError(f"--devices {name}: the deployment runs on {deployment.device}; pass --device {base} "
                                f"to judge on {base} devices")
        if base == "cpu":
            cores = _cores(rest, allowed)
            if len(cores) < (deployment.threads or 1):
                raise ExecutorError(f"--devices {name}: {len(cores)} core(s) for --threads {deployment.threads}; give "
                                    "each device at least as many cores as threads (e.g. cpu:0-1,cpu:2-3)")
            devices.append(Device(name, "cpu", cores, i, device_lock(f"cpu:{','.join(map(str, cores))}")))
        else:
            devices.append(Device(name, _cuda(name, rest), None, i, device_lock(name)))
    _no_shared_cores(devices)
    return devices


def _cuda(name: str, index: str) -> str:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not index.isdigit() or int(index) >= count:
        raise ExecutorError(f"--devices {name}: this machine has {count} CUDA device(s); name cuda:0 to "
                            f"cuda:{max(count - 1, 0)}")
    return name


def _no_shared_cores(devices: list[Device]) -> None:
    seen: dict[int, str] = {}
    for d in devices:
        for c in d.cpus or ():
            if c in seen:
                raise ExecutorError(f"--devices: {seen[c]} and {d.name} share core {c}; two timing slots must not "
                                    "share a core")
            seen[c] = d.name


class LocalExecutor:
    """Subprocess workers (core.workers.Worker) on this machine's devices."""

    name = "local"

    def __init__(self, deployment: Deployment, devices: str | None = None) -> None:
        self.devices = parse_devices(devices, deployment)

    def start(self, deployment: Deployment, recipe: Recipe | None, workspace: str | Path | None, device: Device,
              limit_s: float, start_limit_s: float | None) -> Worker:
        here = deployment if device.torch == deployment.device else dataclasses.replace(deployment, device=device.torch)
        cpus = list(device.cpus) if device.cpus else None
        return Worker(here, recipe, workspace, limit_s, False, start_limit_s, cpus)

    def close(self) -> None:
        """Nothing held beyond the workers, which the judge closes."""
