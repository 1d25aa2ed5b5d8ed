"""Prompt cost on the real pair: `python scripts/prompt_cost.py` (after `specpilot fetch qwen-coder`).

Per request of the bench's first 16: transformers' one forward over the prompt, and our
engine's time before its first decode step (target prefill + drafter reset) under stock-gguf-q4 (the drafter's
prompt in bfloat16 where the CPU has bfloat16 units), stock-gguf (the drafter's prompt on its exact blocks) and
ar+gguf (no drafter)."""
import time

import torch

from specpilot.core.engine import gguf_checkpoint
from specpilot.core.hf import hf_model
from specpilot.core.real_pair import decode_seconds, load
from specpilot.core.recipe import builtin


def main() -> None:
    pair = load(16, threads=1)
    enc, eng = pair.prompts, pair.engine
    hf = hf_model(gguf_checkpoint.resolve(pair.target), "float32", "cpu")
    recipes = {"stock-gguf-q4": builtin("stock-gguf-q4"), "stock-gguf": builtin("stock-gguf")}

    def before_first_step(ids: list[int], recipe, speculative: bool = True) -> float:
        res = eng.generate([ids], 1, recipe, speculative=speculative)
        return res.seconds - decode_seconds(res)

    for recipe in recipes.values():
        before_first_step(enc[0][:80], recipe)  # kernels built, drafter copies made
    totals = {"hf": 0.0, **{name: 0.0 for name in recipes}, "ar+gguf": 0.0}
    with torch.inference_mode():
        for ids in enc:
            t0 = time.perf_counter(); hf(torch.tensor([ids])); seen = {"hf": time.perf_counter() - t0}
            seen.update({name: before_first_step(ids, r) for name, r in recipes.items()})
            seen["ar+gguf"] = before_first_step(ids, recipes["stock-gguf"], speculative=False)
            for name, s in seen.items():
                totals[name] += s
            print(len(ids), ", ".join(f"{name} {s:.2f} s" for name, s in seen.items()), flush=True)
    print("total prompt tokens", sum(len(ids) for ids in enc), ", ".join(f"{name} {s:.1f} s" for name, s in totals.items()))


if __name__ == "__main__":
    main()
