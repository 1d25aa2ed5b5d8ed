"""What one verify step of the q8 target costs by the depths its rows draft, at N rows about 300 tokens into their
contexts (after `specpilot fetch qwen-coder`; 1 thread):

    python scripts/ragged_step.py --rows 16

Each case is a ragged step as the scheduler's verify runs it (`sizes`, and the real nodes' logits alone where the
engine has `packed`), then the greedy argmax; best of `--repeats`, the cache restored before each. Cases: every
row plain; one row drafting 1 or 4 tokens; four rows drafting 1; every row drafting 1 or 4. It prints ms per step:
what a few drafts cost beside many plain rows (docs/RESULTS.md, "On the Xeon: a few drafts in a wide step,
packed, on the tiles' VNNI tail and priced as measured").
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch


def main() -> None:
    from specpilot.core.engine import Engine
    from specpilot.core.engine import gguf_checkpoint
    from specpilot.core.fetch import fetch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = fetch("qwen-coder", progress=None)["target"]
    model = Engine.load(gguf_checkpoint.resolve(target), None, numerics="q8").target
    n, ctx = args.rows, args.context
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(n, ctx + 16)
    for r in range(n):
        model.prefill_row(cache, r, torch.randint(100, 20000, (ctx,), generator=gen).tolist())
    saved = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
    packed = {"packed": True} if "packed" in inspect.signature(model.step).parameters else {}

    def run(sizes: list[int]) -> float:
        t = max(sizes)
        tokens = torch.randint(100, 20000, (n, t), generator=gen)
        depths = torch.arange(t).expand(n, t)
        anc = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(n, t, t)
        best = float("inf")
        for _ in range(args.repeats):
            for mine, kept in zip((cache.k, cache.v, cache.lengths), saved):
                mine.copy_(kept)
            t0 = time.perf_counter()
            out = model.step(tokens, cache, cache.lengths.clone(), depths, anc, sizes=sizes, **packed)
            out.argmax(-1).tolist()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    cases = {"plain": [1] * n, "one drafts 1": [2] + [1] * (n - 1), "one drafts 4": [5] + [1] * (n - 1),
             "four draft 1": [2] * 4 + [1] * (n - 4), "all draft 1": [2] * n, "all draft 4": [5] * n}
    for name, sizes in cases.items():
        print(f"{n} rows, {name:13s} {sum(sizes):3d} tokens {run(sizes):7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
