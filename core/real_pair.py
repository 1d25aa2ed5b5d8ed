"""The real pair for the benchmark scripts, loaded one way: `from specpilot.core.real_pair import load`.

Paths come from `specpilot fetch qwen-coder` (a second fetch returns the cached files at once), requests from
the shipped workloads/coding_chat.jsonl through the target's chat template, and the engine holds both models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specpilot.core.deployment import WORKLOADS

WORKLOAD = WORKLOADS / "coding_chat.jsonl"


@dataclass
class RealPair:
    """Qwen2.5-Coder-1.5B-Instruct with its 0.5B drafter, and the first requests of a split, encoded."""

    target: str  # the GGUF files, as fetched
    drafter: str
    tokenizer: Any
    requests: list  # core.workload.Request
    prompts: list[list[int]]
    engine: Any  # core.engine.engine.Engine


def load(n: int | None = 16, split: str = "all", threads: int | None = 1, engine: bool = True,
         numerics: str = "f32") -> RealPair:
    """The pair and the first `n` requests of `split` (all when None); torch on `threads` threads unless None;
    the engine's target in `numerics` (core/engine/numerics.py)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    from specpilot.core import workload
    from specpilot.core.engine import gguf_checkpoint
    from specpilot.core.engine.engine import Engine
    from specpilot.core.fetch import fetch

    paths = fetch("qwen-coder")
    target, drafter = gguf_checkpoint.resolve(paths["target"]), gguf_checkpoint.resolve(paths["drafter"])
    tok = AutoTokenizer.from_pretrained(target)
    reqs = workload.split(workload.load(str(WORKLOAD)), split)[:n]
    return RealPair(paths["target"], paths["drafter"], tok, reqs, [workload.encode(tok, r) for r in reqs],
                    Engine.load(target, drafter, numerics=numerics) if engine else None)


def decode_seconds(result: Any) -> float:
    """Seconds a generate result spent in its decode steps (draft, verify, commit, host), prompt excluded."""
    return result.decode_seconds()
