"""`python scripts/acceptance_replay.py [REQUESTS=16] [NEW_TOKENS=128] [THREADS=2]` (after `specpilot fetch
qwen-coder`): tokens per verify step of chains and dynamic trees on the real pair, on the same guesses.

The target (stock-gguf-q4's: the 1.5B on its blocks) decodes each request once; the q4 drafter's guesses are
replayed for every shape (core/costmodel/replay.py: static shapes walk the recorded ranks, dynamic trees run
the drafter itself at every step on the true context), so the shapes differ only in their tree. Prints one
row per shape: tokens per step (the bonus token counted), nodes verified per step, drafter ms per step."""
import json
import sys
import time

from specpilot.core.costmodel import replay as rp
from specpilot.core.engine.drafters import TreeSpec
from specpilot.core.real_pair import load
from specpilot.core.recipe import builtin

SHAPES = [("chain", 4, None), ("chain", 6, None), ("chain", 8, None),
          ("dynamic", 6, 8), ("dynamic", 6, 16), ("dynamic", 8, 16), ("dynamic", 6, 32), ("dynamic", 8, 32),
          ("static", 8, 8), ("static", 8, 16), ("static", 8, 32)]


def main(n: int, new_tokens: int, threads: int) -> None:
    pair = load(n, threads=threads)
    recipe = builtin("stock-gguf-q4")
    target, drafter = pair.engine.models_for(recipe)
    t0 = time.perf_counter()
    traces = rp.record(target, pair.prompts, [new_tokens] * n)
    replay = rp.teacher_force(drafter, traces, "model")
    print(f"{n} requests x {new_tokens} tokens recorded and teacher-forced in {time.perf_counter() - t0:.0f} s",
          flush=True)
    rows = []
    for kind, depth, budget in SHAPES:
        t1 = time.perf_counter()
        if kind == "chain":
            spec = TreeSpec("static", [[0] * depth])
            label = f"chain {depth}"
        elif kind == "dynamic":
            spec = TreeSpec("dynamic", None, depth=depth, topk=4, budget=budget)
            label = f"dynamic {budget} nodes, depth {depth}"
        else:
            spec = TreeSpec("static", rp.best_tree(replay, budget, depth))
            label = f"best static {budget} nodes, depth {depth}"
        sim = rp.run(replay, spec)
        rows.append({"shape": label, "tokens_per_step": sim.mean_accepted, "nodes_per_step": sim.mean_nodes,
                     "steps": sim.steps, "draft_ms_per_step": sim.draft_ms if kind == "dynamic" else None})
        print(f"{label:<32} {sim.mean_accepted:5.2f} tokens/step  {sim.mean_nodes:5.1f} nodes verified/step  "
              f"{sim.steps} steps ({time.perf_counter() - t1:.0f} s)", flush=True)
    print(json.dumps({"requests": n, "new_tokens": new_tokens, "threads": threads, "shapes": rows}))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 16, int(a[1]) if len(a) > 1 else 128, int(a[2]) if len(a) > 2 else 2)
