"""`python scripts/decode_threads.py THREADS` (after `specpilot fetch qwen-coder`): ms per new token after the
prompt on the real pair, request 0 of the coding set, for our AR on the GGUF blocks and stock-gguf-q4 (median
of 3). It is the check for how decoding scales with threads, e.g. 1 against 2."""
import statistics
import sys
import time

from specpilot.core.real_pair import load
from specpilot.core.recipe import builtin


def main(threads: int) -> None:
    pair = load(1, threads=threads)
    ids, engine = pair.prompts[0], pair.engine
    recipe = builtin("stock-gguf-q4")
    for name, speculative in (("ar+gguf", False), ("stock-gguf-q4", True)):
        engine.generate([ids], 4, recipe, speculative=speculative)  # warm: kernels built, caches allocated
        per = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.generate([ids], 1, recipe, speculative=speculative)
            t1 = time.perf_counter()
            engine.generate([ids], 65, recipe, speculative=speculative)
            per.append(((time.perf_counter() - t1) - (t1 - t0)) / 64 * 1e3)
        print(f"{name}: {statistics.median(per):.1f} ms/token decode ({threads} threads), runs "
              f"{', '.join(f'{p:.1f}' for p in per)}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
