"""A small but complete deployment for loop tests: the demo tokenizer, a tiny target, a noisy-copy drafter,
and a few requests from the shipped code workload."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import tiny_models

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "models" / "tokenizer"


def build(root: Path, requests: int = 6, max_new_tokens: int = 12) -> dict:
    """Write target/, drafter/ and workload.jsonl under `root`; returns deployment options."""
    target = tiny_models.build(root / "target", "llama2", vocab=4096, hidden=64, layers=2, init=0.08, seed=11,
                               max_position_embeddings=512)
    drafter = tiny_models.build(root / "drafter", "llama2", vocab=4096, hidden=64, layers=2, init=0.08, seed=11,
                                max_position_embeddings=512)
    with torch.no_grad():
        torch.manual_seed(2)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    drafter.save_pretrained(root / "drafter")
    for name in ("target", "drafter"):
        for f in TOKENIZER.glob("*"):
            shutil.copy(f, root / name / f.name)
    lines = (ROOT / "workloads" / "code.jsonl").read_text().splitlines()[: 2 * requests]
    rows = [{**json.loads(line), "max_new_tokens": max_new_tokens} for line in lines]
    (root / "workload.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {"target": str(root / "target"), "drafter": str(root / "drafter"),
            "workload": str(root / "workload.jsonl"), "target_model": target}
