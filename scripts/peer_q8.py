"""`python scripts/peer_q8.py [--prompts 2] [--tokens 64] [--rounds 3] [--recipes stock-gguf-q4,ngram-gguf]
[--llama-bench PATH] [--json OUT]` (after `specpilot fetch qwen-coder`).

Decoding alone under the q8 numerics, interleaved with llama.cpp under the same load, 1 thread: llama.cpp AR
(llama-bench tg, prompt p0) against our q8 AR and q8 recipes (tokens per second of the decode loop after the
prompt), median over rounds; and how many of every q8 recipe's outputs differ from q8 AR's (none may: bit for
bit). scripts/headline.py --numerics q8 runs it for its decoding-alone column."""
import argparse
import json
import statistics
import subprocess

from specpilot.core.real_pair import decode_seconds, load
from specpilot.core.recipe import resolve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--recipes", default="stock-gguf-q4,ngram-gguf", help="built-in names or .toml files")
    p.add_argument("--llama-bench", default="llama-bench")
    p.add_argument("--json", default=None, help="write {system: tok/s median, 'differing': {recipe: n}} here")
    args = p.parse_args()
    pair = load(args.prompts, threads=1, numerics="q8")
    eng = pair.engine
    recipes = {name: resolve(name, True) for name in args.recipes.split(",") if name}
    res: dict[str, list[float]] = {"llama.cpp AR": [], "ours q8 AR": [], **{f"ours q8 {n}": [] for n in recipes}}
    differ = dict.fromkeys(recipes, 0)
    plain = {}
    for i, ids in enumerate(pair.prompts):  # warm every model and kernel once; q8 AR's tokens for the comparison
        plain[i] = eng.generate([ids], args.tokens, None, speculative=False).tokens[0]
        for r in recipes.values():
            eng.generate([ids], 4, r)
    for rnd in range(args.rounds):
        out = subprocess.run([args.llama_bench, "-m", pair.target, "-t", "1", "-p", "0", "-n", str(args.tokens),
                              "-r", "1", "-o", "csv"], capture_output=True, text=True, check=True).stdout
        res["llama.cpp AR"].append(float(out.strip().splitlines()[-1].split(",")[-2].strip('"')))
        for name, recipe in (("ours q8 AR", None), *((f"ours q8 {n}", r) for n, r in recipes.items())):
            made, secs = 0, 0.0
            for i, ids in enumerate(pair.prompts):
                g = eng.generate([ids], args.tokens, recipe, speculative=recipe is not None)
                if recipe is not None and rnd == 0:
                    differ[name.removeprefix("ours q8 ")] += g.tokens[0] != plain[i]
                made += len(g.tokens[0])
                secs += decode_seconds(g)
            res[name].append(made / secs)
        print(rnd, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    summary = {k: statistics.median(v) for k, v in res.items()}
    print({k: round(v, 2) for k, v in summary.items()}, f"outputs differing from q8 AR: {differ}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tok_per_s": summary, "differing": differ, "prompts": args.prompts, "tokens": args.tokens}, f)


if __name__ == "__main__":
    main()
