"""`python scripts/serve_vs_generate.py THREADS REQUESTS NEW_TOKENS` (after `specpilot fetch qwen-coder`): the
serving path at batch 1 against `generate`, stock-gguf-q4 and AR on the blocks, the first REQUESTS coding
requests one after another, two rounds; tok/s of each and the phases' totals. It is the check that continuous
batching with one request in flight costs what single-request generation costs."""
import sys
import time

from specpilot.core.real_pair import load
from specpilot.core.recipe import builtin


def phases(result) -> dict[str, int]:
    s = result.summary()
    return {k: round(s[k]) for k in ("draft_ms", "verify_ms", "commit_ms", "host_ms")}


def main(threads: int, n_requests: int, new: int) -> None:
    pair = load(n_requests, threads=threads)
    prompts, engine = pair.prompts, pair.engine
    recipe = builtin("stock-gguf-q4")
    engine.generate([prompts[0]], 4, recipe)  # warm: kernels built, drafter copies made
    engine.serve([prompts[0]], [4], recipe, 1)
    for rnd in range(2):
        t0 = time.perf_counter()
        gen = [engine.generate([p], new, recipe) for p in prompts]
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        served = engine.serve(prompts, [new] * len(prompts), recipe, 1)
        t_serve = time.perf_counter() - t0
        t0 = time.perf_counter()
        ar = engine.serve(prompts, [new] * len(prompts), recipe, 1, speculative=False)
        t_ar = time.perf_counter() - t0
        gen_tokens = sum(r.new_tokens for r in gen)
        gen_phases = {k: sum(phases(r)[k] for r in gen) for k in ("draft_ms", "verify_ms", "commit_ms", "host_ms")}
        print(f"round {rnd}: generate {gen_tokens / t_gen:.2f} tok/s {gen_phases}; serve(batch 1) "
              f"{served.new_tokens / t_serve:.2f} tok/s {phases(served)}; AR served {ar.new_tokens / t_ar:.2f} tok/s",
              flush=True)


if __name__ == "__main__":
    threads, requests, new_tokens = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1, 4, 48)
    main(threads, requests, new_tokens)
