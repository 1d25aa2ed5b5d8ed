"""Prompt cost on the real pair: `python scripts/prompt_cost.py` (after `specpilot fetch qwen-coder`).

Per request of the bench's first 16: transformers' one forward over the prompt, and our
engine's time before its first decode step (target prefill + drafter reset) under stock-gguf-q4 (the drafter's
prompt in bfloat16 where the CPU has bfloat16 units), stock-gguf (the drafter's prompt on its exact blocks) and
ar+gguf (no drafter)."""
import time

import torch

torch.set_num_threads(1)
from core import workload
from core.engine import gguf
from core.engine.engine import Engine
from core.fetch import fetch
from core.recipe import builtin
from core.hf import hf_model
from transformers import AutoTokenizer
paths = fetch("qwen-coder")  # the cached files (a second fetch returns at once), wherever the cache root is
t, d = gguf.resolve(paths["target"]), gguf.resolve(paths["drafter"])
tok = AutoTokenizer.from_pretrained(t)
reqs = workload.split(workload.load("workloads/coding_chat.jsonl"), "all")[:16]
enc = [workload.encode(tok, r) for r in reqs]
hf = hf_model(t, "float32", "cpu")
eng = Engine.load(t, d)
recipes = {"stock-gguf-q4": builtin("stock-gguf-q4"), "stock-gguf": builtin("stock-gguf")}


def before_first_step(ids: list[int], recipe, speculative: bool = True) -> float:
    res = eng.generate([ids], 1, recipe, speculative=speculative)
    return res.seconds - sum(s.draft_ms + s.verify_ms + s.commit_ms + s.host_ms for s in res.steps) / 1e3


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
