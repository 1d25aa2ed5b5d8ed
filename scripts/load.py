"""An async load generator for OpenAI-compatible servers, on the official `openai` client, loopback only.

    python scripts/load.py --serve "specpilot serve --recipe stock-gguf-q4 ..." --concurrency 1,4,16 \
        --requests 16 --max-tokens 128 --reference ref.json --json out.jsonl --name ours

At each concurrency, `--requests` coding_chat requests (streamed, greedy, 128 tokens) are kept `concurrency` in
flight, bounded in count and in time (`--time-limit` seconds a level: no request starts after it). Reported:
requests/s, output tok/s, time to first token and inter-token latency (a request's decode time over its
tokens after the first) at p50 and p99, and with `--reference` (transformers' greedy texts, written once with
`--make-reference`), how many outputs differ. `--serve CMD` starts the server, waits for /v1/models, and
stops it (SIGTERM) after the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "workloads" / "coding_chat.jsonl"


def requests(n: int) -> list:
    from specpilot.core import workload

    return workload.load(str(WORKLOAD))[:n]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, text, tokens, chunks, timings = None, [], None, 0, None
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(ch.choices[0].delta.content)
            chunks += 1
        if getattr(ch, "usage", None):
            tokens = ch.usage.completion_tokens
        timings = (getattr(ch, "model_extra", None) or {}).get("timings", timings)  # llama-server's own report
    end = time.perf_counter()
    tokens = tokens if tokens is not None else chunks
    first = first or end
    return {"text": "".join(text), "tokens": tokens, "ttft": first - start,
            "itl": (end - first) / max(tokens - 1, 1), "end": end, "timings": timings}


async def level(url: str, model: str, reqs: list, concurrency: int, max_tokens: int, time_limit: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    queue = list(enumerate(reqs))
    results: dict[int, dict] = {}
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue and time.perf_counter() - t0 < time_limit:
            i, r = queue.pop(0)
            results[i] = await one(client, model, r.prompt, max_tokens)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = max(r["end"] for r in results.values()) - t0
    done = list(results.values())
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall, "requests_per_s": len(done) / wall,
            "output_tok_per_s": sum(r["tokens"] for r in done) / wall,
            "ttft_p50": pct([r["ttft"] for r in done], 0.5), "ttft_p99": pct([r["ttft"] for r in done], 0.99),
            "itl_p50": pct([r["itl"] for r in done], 0.5), "itl_p99": pct([r["itl"] for r in done], 0.99),
            "decode_tok_per_s": decode_rate([r["timings"] for r in done]),
            "texts": {str(reqs[i].id): r["text"] for i, r in results.items()}}


def decode_rate(timings: list) -> float | None:
    """Tokens per second of decoding alone, prompt excluded, from a server's own per-request timings
    (llama-server reports predicted_n and predicted_ms); None when the server reports none."""
    if not timings or any(t is None for t in timings):
        return None
    return sum(t["predicted_n"] for t in timings) / (sum(t["predicted_ms"] for t in timings) / 1e3)


def make_reference(target_dir: str, n: int, max_tokens: int, path: str) -> None:
    """transformers' float32 greedy text for the first n requests, through the checkpoint's chat template."""
    import torch
    from transformers import AutoTokenizer

    from specpilot.core import workload
    from specpilot.core.hf import hf_model

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = hf_model(target_dir)
    out = {}
    for r in requests(n):
        ids = workload.encode(tok, r)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0, len(ids):]
        out[str(r.id)] = tok.decode(gen, skip_special_tokens=True)
        print(f"reference {r.id}: {len(gen)} tokens", file=sys.stderr, flush=True)
    Path(path).write_text(json.dumps(out, indent=1))


def wait_ready(url: str, proc: subprocess.Popen, limit: float = 900) -> str:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1)
    raise SystemExit(f"no server at {url} after {limit} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--serve", default=None, help="server command to start (and stop) around the run")
    p.add_argument("--name", default="server", help="the system's name in the output")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=16,
                   help="requests per concurrency level (at least the concurrency: every client sends one)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--time-limit", type=float, default=900, help="seconds a level may start requests")
    p.add_argument("--reference", default=None, help="JSON {request id: transformers' greedy text}")
    p.add_argument("--make-reference", default=None, metavar="TARGET_DIR",
                   help="write --reference from transformers on this checkpoint directory, then exit")
    p.add_argument("--json", default=None, help="append one JSON line per level here")
    args = p.parse_args()
    if args.make_reference:
        make_reference(args.make_reference, args.requests, args.max_tokens, args.reference)
        return 0
    proc = subprocess.Popen(shlex.split(args.serve)) if args.serve else None
    try:
        model = wait_ready(args.url, proc)
        reference = json.loads(Path(args.reference).read_text()) if args.reference else None
        for c in (int(x) for x in args.concurrency.split(",")):
            reqs = requests(max(args.requests, c))
            res = asyncio.run(level(args.url, model, reqs, c, args.max_tokens, args.time_limit))
            texts = res.pop("texts")
            if reference is not None:
                res["mismatches"] = sum(texts[k] != reference[k] for k in texts if k in reference)
            res["system"] = args.name
            print(f"{args.name} c={c}: {res['requests']} req, {res['output_tok_per_s']:.2f} tok/s, "
                  f"{res['requests_per_s']:.3f} req/s, TTFT p50 {res['ttft_p50']:.2f} s p99 {res['ttft_p99']:.2f} s, "
                  f"ITL p50 {res['itl_p50'] * 1e3:.0f} ms p99 {res['itl_p99'] * 1e3:.0f} ms"
                  + (f", decoding alone {res['decode_tok_per_s']:.2f} tok/s" if res["decode_tok_per_s"] else "")
                  + (f", {res['mismatches']} mismatched" if "mismatches" in res else ""), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({**res, "texts": texts}) + "\n")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
