"""`LLAMA_BENCH=/path/to/llama-bench python scripts/peer_llama.py` (after `specpilot fetch qwen-coder`).

Decode speed, interleaved under the same load: llama.cpp AR (llama-bench tg64, 1 thread) against our AR and
stock-gguf and stock-gguf-q4 on the GGUF blocks (tokens per second of the decode loop after the prompt,
prompt p0), 3 rounds."""
import os
import statistics
import subprocess

from specpilot.core.real_pair import decode_seconds, load
from specpilot.core.recipe import builtin


def main() -> None:
    pair = load(1, threads=1)
    ids, eng = pair.prompts[0], pair.engine
    sg, q4 = builtin("stock-gguf"), builtin("stock-gguf-q4")
    eng.generate([ids], 4, sg); eng.generate([ids], 4, sg, speculative=False); eng.generate([ids], 4, q4)
    bench = os.environ.get("LLAMA_BENCH", "llama-bench")
    res = {"llama.cpp AR": [], "ours AR (gguf)": [], "ours stock-gguf": [], "ours stock-gguf-q4": []}
    for r in range(3):
        out = subprocess.run([bench, "-m", pair.target, "-t", "1", "-p", "0", "-n", "64", "-r", "1", "-o", "csv"], capture_output=True, text=True).stdout
        tps = float(out.strip().splitlines()[-1].split(",")[-2].strip('"'))
        res["llama.cpp AR"].append(tps)
        for name, recipe, spec in (("ours AR (gguf)", sg, False), ("ours stock-gguf", sg, True),
                                   ("ours stock-gguf-q4", q4, True)):
            g = eng.generate([ids], 64, recipe, speculative=spec)
            loop = decode_seconds(g)
            res[name].append(len(g.tokens[0]) / loop)
        print(r, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    print({k: round(statistics.median(v), 2) for k, v in res.items()})


if __name__ == "__main__":
    main()
