"""Engine micro-benchmark (issue: engine): our AR vs transformers `generate` on random-weight models of the
demo pair's shapes, interleaved, median over repeats; plus per-call cost of the drafter vs the target.

    .venv/bin/python scripts/bench_engine.py --dtype bfloat16 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import transformers

from specpilot.core.engine import Engine

TARGET = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
DRAFTER = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def build(cfg: dict, seed: int) -> tuple[str, transformers.LlamaForCausalLM]:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    return path, model


def call_ms(model, tokens: int, context: int = 100, repeats: int = 50) -> float:
    cache = model.new_cache(1, context + tokens + 1)
    cache.lengths.fill_(context)
    toks = torch.zeros(1, tokens, dtype=torch.long)
    depths = torch.arange(tokens)[None]
    anc = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))[None] if tokens > 1 else None
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.step(toks, cache, cache.lengths, depths, anc)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tdir, hf = build(TARGET, 0)
    ddir, _ = build(DRAFTER, 1)
    engine = Engine.load(tdir, ddir, args.dtype)
    hf = hf.to(getattr(torch, args.dtype))
    prompt = torch.randint(0, 4096, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    n = args.new_tokens

    def ours() -> tuple[float, list[int]]:
        r = engine.generate([prompt], n, speculative=False)
        return r.seconds, r.tokens[0]

    def theirs() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    ours(), theirs()
    a, b = [], []
    for _ in range(args.repeats):
        a.append(ours()[0])
        b.append(theirs()[0])
    ref = Engine.load(tdir, ddir, "float32")
    hf32 = hf.float()
    with torch.inference_mode():
        hf_tokens = hf32.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    equal_fp32 = ref.generate([prompt], n, speculative=False).tokens[0] == hf_tokens
    target_ms = {t: call_ms(engine.target, t) for t in (1, 4, 16, 64)}
    drafter_ms = call_ms(engine.drafter_model, 1)
    print(json.dumps({
        "dtype": args.dtype, "threads": args.threads, "new_tokens": n, "repeats": args.repeats,
        "ours_ar_tokens_per_s": n / statistics.median(a), "hf_ar_tokens_per_s": n / statistics.median(b),
        "ours_over_hf": statistics.median(b) / statistics.median(a), "equal_outputs_float32": equal_fp32,
        "target_call_ms": target_ms, "drafter_call_ms": drafter_ms,
        "drafter_over_target_call": drafter_ms / target_ms[1],
    }, indent=2))


if __name__ == "__main__":
    main()
