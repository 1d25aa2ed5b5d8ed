"""`LLAMA_BENCH=/path/to/llama-bench python scripts/peer_q8.py [N_PROMPTS] [TOKENS]` (after `specpilot fetch qwen-coder`).

Decoding alone under the q8 numerics, interleaved with llama.cpp under the same load, 1 thread: llama.cpp AR
(llama-bench tg, prompt p0) against our q8 AR and q8 recipes (tokens per second of the decode loop after the
prompt), 3 rounds, median; and whether every q8 recipe's tokens equal q8 AR's (they must, bit for bit)."""
import os
import statistics
import subprocess
import sys

from real_pair import decode_seconds, load

from specpilot.core.recipe import builtin

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 2
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
pair = load(n_prompts, threads=1, numerics="q8")
eng = pair.engine
recipes = {name: builtin(name) for name in ("stock-gguf-q4", "ngram-gguf", "chain6")}
bench = os.environ.get("LLAMA_BENCH", "llama-bench")
res: dict[str, list[float]] = {"llama.cpp AR": [], "ours q8 AR": [], **{f"ours q8 {n}": [] for n in recipes}}
differ = 0
for ids in pair.prompts:  # warm every model and kernel once
    eng.generate([ids], 4, None, speculative=False)
    for r in recipes.values():
        eng.generate([ids], 4, r)
for rnd in range(3):
    out = subprocess.run([bench, "-m", pair.target, "-t", "1", "-p", "0", "-n", str(tokens), "-r", "1", "-o", "csv"],
                         capture_output=True, text=True).stdout
    res["llama.cpp AR"].append(float(out.strip().splitlines()[-1].split(",")[-2].strip('"')))
    for name, recipe in (("ours q8 AR", None), *((f"ours q8 {n}", r) for n, r in recipes.items())):
        made, secs = 0, 0.0
        for ids in pair.prompts:
            g = eng.generate([ids], tokens, recipe, speculative=recipe is not None)
            if recipe is not None and rnd == 0:
                differ += g.tokens[0] != eng.generate([ids], tokens, None, speculative=False).tokens[0]
            made += len(g.tokens[0])
            secs += decode_seconds(g)
        res[name].append(made / secs)
    print(rnd, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
print({k: round(statistics.median(v), 2) for k, v in res.items()}, f"outputs differing from q8 AR: {differ}")
