"""A deployment: target, drafter, workload, device and dtype; the shipped demo is the default."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = ROOT / "models" / "demo-target"
DEMO_DRAFTER = ROOT / "models" / "demo-drafter"
DEMO_WORKLOAD = ROOT / "workloads" / "code.jsonl"


@dataclass
class Deployment:
    target: str = str(DEMO_TARGET)
    drafter: str | None = str(DEMO_DRAFTER)
    workload: str = str(DEMO_WORKLOAD)
    device: str = "cpu"
    dtype: str = "bfloat16"

    @classmethod
    def from_args(cls, args) -> "Deployment":
        """From argparse options --target/--drafter/--workload/--device/--dtype (missing ones: the demo)."""
        d = cls()
        for key in ("target", "drafter", "workload", "device", "dtype"):
            value = getattr(args, key, None)
            if value is not None:
                setattr(d, key, str(value))
        return d

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Identity of the deployment for memory: model configs, device kind and dtype, not paths."""
        parts = [self.device.split(":")[0], self.dtype]
        for path in (self.target, self.drafter):
            cfg = Path(path or "") / "config.json"
            parts.append(cfg.read_text() if path and cfg.is_file() else "none")
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def describe(self) -> str:
        drafter = Path(self.drafter).name if self.drafter else "none"
        return f"{Path(self.target).name} + {drafter} on {self.device} ({self.dtype})"
