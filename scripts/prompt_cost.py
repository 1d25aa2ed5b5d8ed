"""Prompt cost on the real pair: `python scripts/prompt_cost.py` (after `specpilot fetch qwen-coder`).

Per request of the bench's first 16: transformers' one forward over the prompt, and our
engine's time before its first decode step (target prefill + drafter reset) under stock-gguf and ar+gguf."""
import time

import torch

torch.set_num_threads(1)
from core import workload
from core.engine import gguf
from core.engine.engine import Engine
from core.recipe import builtin
from core.hf import hf_model
from transformers import AutoTokenizer
M = "/root/.cache/specpilot/models/"
t, d = gguf.resolve(M + "qwen2.5-coder-1.5b-instruct.gguf"), gguf.resolve(M + "qwen2.5-coder-0.5b-instruct.gguf")
tok = AutoTokenizer.from_pretrained(t)
reqs = workload.split(workload.load("workloads/coding_chat.jsonl"), "all")[:16]
enc = [workload.encode(tok, r) for r in reqs]
hf = hf_model(t, "float32", "cpu")
eng = Engine.load(t, d)
rec = builtin("stock-gguf")
rows = []
with torch.inference_mode():
    for ids in enc:
        x = torch.tensor([ids])
        t0 = time.perf_counter(); hf(x); h = time.perf_counter() - t0
        res = eng.generate([ids], 1, rec)
        pre = res.seconds - sum(s.draft_ms + s.verify_ms + s.commit_ms + s.host_ms for s in res.steps) / 1e3
        res2 = eng.generate([ids], 1, rec, speculative=False)
        pre2 = res2.seconds - sum(s.draft_ms + s.verify_ms + s.commit_ms + s.host_ms for s in res2.steps) / 1e3
        rows.append((len(ids), h, pre, pre2))
        print(len(ids), f"hf {h:.2f} s, stock-gguf {pre:.2f} s, ar+gguf {pre2:.2f} s", flush=True)
print("total prompt tokens", sum(r[0] for r in rows), "hf", round(sum(r[1] for r in rows), 1), "stock-gguf",
      round(sum(r[2] for r in rows), 1), "ar+gguf", round(sum(r[3] for r in rows), 1))
