"""`LLAMA_BENCH=/path/to/llama-bench python scripts/peer_llama.py` (after `specpilot fetch qwen-coder`).

Decode speed, interleaved under the same load: llama.cpp AR (llama-bench tg64, 1 thread) against our AR and
stock on the GGUF blocks (ms per new token after the prompt, prompt p0), 3 rounds."""
import os
import statistics
import subprocess

import torch

torch.set_num_threads(1)
from core import workload
from core.engine import gguf
from core.engine.engine import Engine
from core.recipe import builtin
from transformers import AutoTokenizer
M = "/root/.cache/specpilot/models/"
t, d = gguf.resolve(M + "qwen2.5-coder-1.5b-instruct.gguf"), gguf.resolve(M + "qwen2.5-coder-0.5b-instruct.gguf")
tok = AutoTokenizer.from_pretrained(t)
reqs = workload.split(workload.load("workloads/coding_chat.jsonl"), "all")
ids = workload.encode(tok, reqs[0])
eng = Engine.load(t, d)
sg = builtin("stock-gguf")
eng.generate([ids], 4, sg); eng.generate([ids], 4, sg, speculative=False)
bench = os.environ.get("LLAMA_BENCH", "llama-bench")
res = {"llama.cpp AR": [], "ours AR (gguf)": [], "ours stock-gguf": []}
for r in range(3):
    out = subprocess.run([bench, "-m", M + "qwen2.5-coder-1.5b-instruct.gguf", "-t", "1", "-p", "0", "-n", "64", "-r", "1", "-o", "csv"], capture_output=True, text=True).stdout
    tps = float(out.strip().splitlines()[-1].split(",")[-2].strip('"'))
    res["llama.cpp AR"].append(tps)
    for name, spec in (("ours AR (gguf)", False), ("ours stock-gguf", True)):
        g = eng.generate([ids], 64, sg, speculative=spec)
        loop = sum(s.draft_ms + s.verify_ms + s.commit_ms + s.host_ms for s in g.steps) / 1e3
        res[name].append(len(g.tokens[0]) / loop)
    print(r, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
print({k: round(statistics.median(v), 2) for k, v in res.items()})
