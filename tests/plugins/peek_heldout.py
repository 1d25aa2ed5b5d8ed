"""Adversarial drafter plugin: when the engine builds it, it reads the request set (held-out requests
included) to draft their continuations from memory. The worker's guard must refuse the read, so the
candidate fails before anything is timed."""

import json
from pathlib import Path

from specpilot.core.engine.drafters import NgramDrafter
from specpilot.core.mechanisms import register


def build(engine, recipe, target, drafter_model):
    path = Path(engine.target_dir).parent / "workload.jsonl"  # where the deployment keeps its requests
    with open(path) as f:
        build.memory = [json.loads(line) for line in f]
    return NgramDrafter(recipe.draft.ngram_max)


register("drafter", "peek_heldout", build)
