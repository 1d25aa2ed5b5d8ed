"""A deployment: target, drafter, workload, device, dtype and numerics; the shipped demo is the default."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

MODELS = Path(str(files("specpilot.models")))  # package data: the checkout's models/ or the installed copy
WORKLOADS = Path(str(files("specpilot.workloads")))
DEMO_TARGET = MODELS / "demo-target"
DEMO_DRAFTER = MODELS / "demo-drafter"
DEMO_WORKLOAD = WORKLOADS / "code.jsonl"


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA; float32 on a CPU, even one with AVX-512 BF16: the forcing reference and the fused
    layer are float32, and a bfloat16 run differs from the float32 reference at far more than near-ties
    (measured on this kind of machine: 4% of held-out tokens on the mini deployment). --dtype overrides."""
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass
class Deployment:
    target: str = str(DEMO_TARGET)
    drafter: str | None = str(DEMO_DRAFTER)
    workload: str = str(DEMO_WORKLOAD)
    device: str = "cpu"
    dtype: str = "auto"
    threads: int = 0
    target_source: str = ""
    drafter_source: str = ""
    numerics: str = "f32"

    def __post_init__(self) -> None:
        """A `.gguf` target or drafter is materialised once into a cached checkpoint directory (see
        core/engine/gguf_checkpoint.py), so every consumer sees a directory; the file stays named in *_source.
        A GGUF deployment defaults to float32, the dtype its dequantised weights are exact in. Numerics are
        checked here (an unknown name, or q8 on a float checkpoint, is a one-line error)."""
        from specpilot.core.engine import gguf_checkpoint, numerics

        if self.drafter in ("none", ""):
            self.drafter = None
        from_gguf = False
        for role in ("target", "drafter"):
            path = getattr(self, role)
            if path is not None and gguf_checkpoint.is_gguf(path):
                setattr(self, f"{role}_source", str(path))
                setattr(self, role, gguf_checkpoint.resolve(path))
                from_gguf = True
        if self.dtype == "auto":
            self.dtype = "float32" if from_gguf else default_dtype(self.device)
        if self.threads == 0:
            self.threads = 1 if self.device == "cpu" else 0
        numerics.check(self.numerics)
        if self.numerics != "f32" and not self.target_source:
            numerics.require_gguf(self.numerics, self.target)

    def apply_threads(self) -> None:
        """Pin torch's intra-op threads: on a small shared CPU one thread avoids OpenMP spin contention
        (measured here: a 384x1152 GEMV took 21 ms with 2 threads under load, 0.29 ms with 1)."""
        if self.threads > 0:
            import torch

            torch.set_num_threads(self.threads)

    @classmethod
    def from_args(cls, args) -> "Deployment":
        """From argparse options --target/--drafter/--workload/--device/--dtype (missing ones: the demo)."""
        values = {k: str(getattr(args, k)) for k in ("target", "drafter", "workload", "device", "dtype", "numerics")
                  if getattr(args, k, None) is not None}
        if getattr(args, "threads", None):
            values["threads"] = int(args.threads)
        return cls(**values)

    def validate(self) -> "Deployment":
        """Fail early, in one line, on paths that do not exist."""
        from specpilot.core.engine.config import ModelLoadError
        from specpilot.core.workload import WorkloadError

        for role, path in (("target", self.target), ("drafter", self.drafter)):
            if path is not None and not (Path(path) / "config.json").is_file():
                what = "does not exist" if not Path(path).exists() else "has no config.json"
                raise ModelLoadError(f"{role} {path} {what}; pass a local Hugging Face checkpoint directory "
                                     f"(--{role} DIR)")
        if not Path(self.workload).is_file():
            raise WorkloadError(f"workload {self.workload} does not exist; pass a .jsonl file (--workload FILE)")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Identity of the deployment for memory: model configs, device kind, dtype and numerics, not paths
        (f32, the default, adds nothing, so fingerprints stored before numerics existed still match)."""
        parts = [self.device.split(":")[0], self.dtype] + ([self.numerics] if self.numerics != "f32" else [])
        for path in (self.target, self.drafter):
            cfg = Path(path or "") / "config.json"
            parts.append(cfg.read_text() if path and cfg.is_file() else "none")
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def describe(self) -> str:
        target = Path(self.target_source or self.target).name
        drafter = Path(self.drafter_source or self.drafter).name if self.drafter else "none"
        return f"{target} + {drafter} on {self.device} ({self.dtype}, numerics {self.numerics})"
