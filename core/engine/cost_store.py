"""Step costs kept per deployment, so that a server prices its batching policy's steps in seconds.

Measuring a recipe's step costs (batching.measure_costs) takes minutes on a CPU, and the answer depends only on
what runs and where: the target and drafter files, the numerics and dtype, the recipe's weight formats, linear
backend and drafter, the device and its model (the GPU's, or the CPU's), the thread count, and the code a step
runs (a digest of the engine's and kernels' sources: a change to how a step computes can change its price, and a
table measured before it is stale). Those are the identity a table is kept under, as JSON in
`$SPECPILOT_COSTS_DIR` (default: the SpecPilot cache's costs/ folder). A table that is missing, unreadable or
corrupt is measured again and rewritten, never trusted; `specpilot serve --remeasure` measures again on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from specpilot.core.engine.batching import CostTable
from specpilot.kernels import cache_dir

log = logging.getLogger("specpilot.costs")


def costs_dir() -> Path:
    """Where cost tables live."""
    return Path(os.environ.get("SPECPILOT_COSTS_DIR") or cache_dir() / "costs")


def cpu_model() -> str:
    """The CPU's model name (lscpu's), which a table measured on another CPU must not be reused for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """The model of the processor a step runs on: the GPU's for a CUDA device, else the CPU's."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return cpu_model()


@functools.lru_cache(maxsize=1)
def step_code() -> str:
    """A digest of the sources a step runs (core/engine's Python, the CPU kernels' C and Python), so that a
    table measured by other code is measured again rather than trusted."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted([*(root / "core" / "engine").glob("*.py"), *(root / "kernels" / "cpu").glob("*.[ch]"),
                        *(root / "kernels" / "cpu").glob("*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def path_for(identity: dict) -> Path:
    """The file of the table measured for `identity` (every field that changes a step's cost)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return costs_dir() / f"{digest}.json"


UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError)  # what reading a kept file may raise


def _read(path: Path) -> tuple[dict, CostTable]:
    """A kept file's identity and table; one of UNREADABLE if it is not one."""
    data = json.loads(path.read_text())
    return dict(data["identity"]), CostTable.from_dict(data["table"], source=str(path))


def load(identity: dict) -> CostTable | None:
    """The stored table for `identity`, or None (none stored, or one that is unreadable: it is measured again)."""
    path = path_for(identity)
    if not path.is_file():
        return None
    try:
        kept_for, table = _read(path)
        if kept_for != identity:
            raise ValueError("it was measured for another deployment")
        return table
    except UNREADABLE as exc:
        log.warning("step costs in %s are unusable (%s); measuring them again", path, exc)
        return None


def kept() -> list[tuple[Path, dict, CostTable]]:
    """Every readable table in costs_dir(), with its file and identity (unreadable files are skipped, as `load`
    would measure them again)."""
    out = []
    for path in sorted(costs_dir().glob("*.json")):
        try:
            out.append((path, *_read(path)))
        except UNREADABLE:
            continue
    return out


def save(identity: dict, table: CostTable) -> Path:
    """Write `table` for `identity` whole (a temporary file renamed over the old one) and return its path."""
    path = path_for(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"identity": identity, "table": table.to_dict()}, indent=1))
    os.replace(tmp, path)
    return path
