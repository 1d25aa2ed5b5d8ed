"""Where a continuous batch's time goes on the real pair: `python scripts/batch_breakdown.py THREADS REQUESTS
NEW_TOKENS BATCH [SYSTEM ...]`, systems `ar` (batched AR on the blocks) and `budget` / `fixed` (stock-gguf-q4
with that batching policy). Prints one JSON line per system: tok/s, the target's prompts, the drafter's prompts
and catch-up, and the steps' draft / verify time, all from one scheduler run of the requests."""
from __future__ import annotations

import json
import sys
import time

from specpilot.core.real_pair import load
from specpilot.core.recipe import builtin


def timed(obj: object, name: str, spent: dict[str, float]) -> None:
    """Wrap obj.name so its seconds add up in spent[name]."""
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, call)


def main() -> None:
    threads, n, new, batch = (int(a) for a in sys.argv[1:5])
    pair = load(n, threads=threads)
    engine, base = pair.engine, builtin("stock-gguf-q4")
    for name in sys.argv[5:] or ["ar", "budget"]:
        recipe = base if name in ("ar", "fixed") else base.replace(batching={"policy": name})
        speculative = name != "ar"
        table = engine.cost_table(recipe, sorted({1, 4, batch})) if speculative and name != "fixed" else None
        sched = engine.scheduler(recipe, batch, 1024, table, speculative=speculative)
        spent: dict[str, float] = {}
        timed(sched.target, "prefill_row", spent)
        if sched.drafter is not None:
            timed(sched.drafter, "catch_up", spent)
        for p in pair.prompts:
            sched.add(p, new)
        t0, tokens = time.perf_counter(), 0
        while not sched.idle():
            tokens += sum(len(e.tokens) for e in sched.step())
        wall = time.perf_counter() - t0
        steps = sched.steps
        print(json.dumps({"system": name, "threads": threads, "batch": batch, "tok_s": round(tokens / wall, 2),
                          "wall_s": round(wall, 1), "target_prompts_s": round(spent.get("prefill_row", 0.0), 1),
                          "drafter_catch_up_s": round(spent.get("catch_up", 0.0), 1), "steps": len(steps),
                          "draft_s": round(sum(s.draft_ms for s in steps) / 1e3, 1),
                          "verify_s": round(sum(s.verify_ms for s in steps) / 1e3, 1),
                          "drafted_steps": sum(1 for s in steps if s.nodes > len(s.accepted))}), flush=True)


if __name__ == "__main__":
    main()
