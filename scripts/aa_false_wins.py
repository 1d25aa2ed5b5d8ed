"""`python scripts/aa_false_wins.py [TRIALS] [RECIPE] [REQUESTS] [NEW_TOKENS]` (after `specpilot fetch qwen-coder`):
how often the judge calls a candidate identical to the incumbent a win on the real pair.

What the loop does on that pair (`quickstart.sh real`: 2 tuning requests of 48 tokens, 1 thread): one A/A
calibration sets the noise floor, then each trial times a fresh worker running the incumbent's own recipe
against the baseline worker, exactly as the tuning gate times a candidate. Prints the floor, every trial's
interval, and the share judged a win (the tuning gate alone; a real win must also pass held-out)."""
import json
import sys
import time

from specpilot.core import workload
from specpilot.core.deployment import Deployment
from specpilot.core.engine import gguf_checkpoint
from specpilot.core.fetch import fetch
from specpilot.core.judge import Judge, JudgeRequest
from specpilot.core.recipe import builtin


def requests(target: str, which: str, n: int, new_tokens: int) -> list[JudgeRequest]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_checkpoint.resolve(target))
    reqs = workload.load("workloads/coding_chat.jsonl")
    index = {r.id: i for i, r in enumerate(reqs)}
    return [JudgeRequest(r.id, index[r.id], workload.encode(tok, r), new_tokens)
            for r in workload.split(reqs, which, 0)[:n]]


def unforced(*_: object) -> dict:
    raise RuntimeError("this script times only; it never forces")


def main(trials: int, recipe_name: str, n: int, new_tokens: int) -> None:
    paths = fetch("qwen-coder")
    dep = Deployment(target=paths["target"], drafter=paths["drafter"], workload="workloads/coding_chat.jsonl",
                     threads=1)
    tuning = requests(paths["target"], "tuning", n, new_tokens)
    recipe = builtin(recipe_name)
    t0 = time.perf_counter()
    with Judge(dep, tuning, [], unforced, limit_s=600.0, start_limit_s=900.0) as judge:
        aa = judge.calibrate_noise(recipe)
        print(f"calibration: {len(aa)} pairs, bias {judge.noise.bias:+.4f}, spread {judge.noise.spread:.4f}, "
              f"floor {judge.floor:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        wins = 0
        rows = []
        for i in range(trials):
            c = judge.measure(recipe, recipe, tuning)
            wins += c.passed
            rows.append(c.to_dict())
            print(f"trial {i + 1}: {c.speedup:.4f}x [{c.low:.4f}, {c.high:.4f}] needs low > {1 + judge.floor:.4f}: "
                  f"{'WIN' if c.passed else 'no win'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(json.dumps({"recipe": recipe_name, "requests": n, "new_tokens": new_tokens, "floor": judge.floor,
                      "bias": judge.noise.bias, "spread": judge.noise.spread, "aa_pairs": len(aa),
                      "trials": trials, "wins": wins, "win_rate": wins / trials, "comparisons": rows}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 20, args[1] if len(args) > 1 else "stock-gguf-q4",
         int(args[2]) if len(args) > 2 else 2, int(args[3]) if len(args) > 3 else 48)
