"""An async load generator for OpenAI-compatible servers, on the official `openai` client, loopback only.

    python scripts/load.py --serve "specpilot serve --recipe stock-gguf-q4 ..." --concurrency 1,4,16 \
        --requests 16 --max-tokens 128 --reference ref.json --json out.jsonl --name ours

At each concurrency, `--requests` coding_chat requests (streamed, greedy, 128 tokens) are kept `concurrency` in
flight, bounded in count and in time (`--time-limit` seconds a level: no request starts after it). `--system
FILE` puts the same system prompt in front of every request (workloads/system_prompt.txt: the shared-prefix
workload). Reported: requests/s, output tok/s, time to first token and inter-token latency (a request's decode
time over its tokens after the first) at p50 and p99, and with `--reference` (greedy texts written once with
`--make-reference`: transformers float32 on a checkpoint directory, or with `--reference-numerics q8` our own
q8 plain decoding of a .gguf file), how many outputs differ. `--serve CMD` starts the server, waits for
/v1/models, stops it (SIGTERM) after the run, and reports its peak RSS (VmHWM) after each level. Against
`specpilot serve`, each level also reports what its steps drafted, accepted and prefilled, the rows they decoded
and drafted for, the owed tokens the drafter was fed, the seconds of each phase of the steps and its prefix-cache
hits, read from /metrics before and after the level.
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


def messages(prompt: str, system: str | None) -> list[dict]:
    """One chat request: the user's prompt, after the shared system prompt when there is one."""
    user = [{"role": "user", "content": prompt}]
    return user if system is None else [{"role": "system", "content": system}, *user]


async def one(client, model: str, prompt: str, max_tokens: int, system: str | None) -> dict:
    start = time.perf_counter()
    first, text, tokens, chunks, timings = None, [], None, 0, None
    stream = await client.chat.completions.create(model=model, messages=messages(prompt, system),
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


async def level(url: str, model: str, reqs: list, concurrency: int, max_tokens: int, time_limit: float,
                system: str | None) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    queue = list(enumerate(reqs))
    results: dict[int, dict] = {}
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue and time.perf_counter() - t0 < time_limit:
            i, r = queue.pop(0)
            results[i] = await one(client, model, r.prompt, max_tokens, system)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()  # on this event loop, before asyncio.run closes it
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


# Server metrics whose change over a level is reported: what the steps drafted, accepted and prefilled, the rows
# they decoded and drafted for, the owed tokens the drafter was fed; and the seconds of each phase of the steps,
# as "PHASE_s", for every phase the server labels (PHASE_SECONDS).
METRICS = {"steps": "specpilot_step_draft_tokens_count", "drafted": "specpilot_step_draft_tokens_sum",
           "accepted": "specpilot_step_accepted_draft_tokens_sum", "prefilled": "specpilot_step_prefill_tokens_sum",
           "prefix_queries": "specpilot_prefix_cache_queries_total", "prefix_hits": "specpilot_prefix_cache_hits_total",
           "rows": "specpilot_step_rows_sum", "drafting_rows": "specpilot_step_drafting_rows_sum",
           "caught_up": "specpilot_drafter_catch_up_tokens_total"}
PHASE_SECONDS = 'specpilot_step_seconds_total{phase="'


def scrape(url: str) -> dict[str, float] | None:
    """The METRICS of a specpilot server's /metrics (None for a server without them)."""
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
    except (OSError, ValueError):
        return None
    values, phases = {}, {}
    for line in lines:
        name, _, value = line.partition(" ")
        if name in METRICS.values():
            values[name] = float(value)
        elif name.startswith(PHASE_SECONDS):
            phases[name[len(PHASE_SECONDS):].removesuffix('"}') + "_s"] = float(value)
    if len(values) < len(METRICS):
        return None
    return {**{k: values[v] for k, v in METRICS.items()}, **phases}


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM), in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def make_reference(target: str, n: int, max_tokens: int, path: str, system: str | None, numerics: str) -> None:
    """The deployment's own greedy text for the first n requests, through the checkpoint's chat template:
    transformers float32 on a checkpoint directory (f32), or our q8 plain decoding of a .gguf file (q8)."""
    import torch
    from transformers import AutoTokenizer

    from specpilot.core import workload

    if numerics == "q8":
        from specpilot.core.engine import Engine
        from specpilot.core.engine.gguf_checkpoint import materialise

        target = str(materialise(target))
        engine = Engine.load(target, numerics="q8")

        def generate(ids: list[int]) -> list[int]:
            return engine.generate([ids], max_tokens, speculative=False).tokens[0]
    else:
        from specpilot.core.hf import hf_model

        model = hf_model(target)

        def generate(ids: list[int]) -> list[int]:
            with torch.inference_mode():
                return model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    tok = AutoTokenizer.from_pretrained(target)
    out = {}
    for r in requests(n):
        ids = workload.encode(tok, r) if system is None else workload.encode_messages(tok, messages(r.prompt, system))
        gen = generate(ids)
        out[str(r.id)] = tok.decode(gen, skip_special_tokens=True)
        print(f"reference {r.id}: {len(ids)} prompt tokens, {len(gen)} new", file=sys.stderr, flush=True)
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
    p.add_argument("--reference", default=None, help="JSON {request id: the deployment's greedy text}")
    p.add_argument("--make-reference", default=None, metavar="TARGET",
                   help="write --reference from this checkpoint directory (f32) or .gguf file (q8), then exit")
    p.add_argument("--reference-numerics", choices=("f32", "q8"), default="f32",
                   help="the deployment's numerics for --make-reference: transformers float32, or our q8 AR")
    p.add_argument("--system", default=None, metavar="FILE", help="a system prompt in front of every request")
    p.add_argument("--json", default=None, help="append one JSON line per level here")
    args = p.parse_args()
    system = Path(args.system).read_text().strip() if args.system else None
    if args.make_reference:
        make_reference(args.make_reference, args.requests, args.max_tokens, args.reference, system,
                       args.reference_numerics)
        return 0
    proc = subprocess.Popen(shlex.split(args.serve)) if args.serve else None
    try:
        model = wait_ready(args.url, proc)
        reference = json.loads(Path(args.reference).read_text()) if args.reference else None
        for c in (int(x) for x in args.concurrency.split(",")):
            reqs = requests(max(args.requests, c))
            before = scrape(args.url)
            res = asyncio.run(level(args.url, model, reqs, c, args.max_tokens, args.time_limit, system))
            after = scrape(args.url)
            if before is not None and after is not None:
                res["steps"] = {k: after[k] - before.get(k, 0.0) for k in after}
            res["peak_rss_mb"] = None if proc is None else peak_rss_mb(proc.pid)
            res["workload"] = "system" if system else "plain"
            texts = res.pop("texts")
            if reference is not None:
                res["mismatches"] = sum(texts[k] != reference[k] for k in texts if k in reference)
            res["system"] = args.name
            print(f"{args.name} c={c}: {res['requests']} req, {res['output_tok_per_s']:.2f} tok/s, "
                  f"{res['requests_per_s']:.3f} req/s, TTFT p50 {res['ttft_p50']:.2f} s p99 {res['ttft_p99']:.2f} s, "
                  f"ITL p50 {res['itl_p50'] * 1e3:.0f} ms p99 {res['itl_p99'] * 1e3:.0f} ms"
                  + (f", decoding alone {res['decode_tok_per_s']:.2f} tok/s" if res["decode_tok_per_s"] else "")
                  + (f", {res['mismatches']} mismatched" if "mismatches" in res else "")
                  + (f", peak RSS {res['peak_rss_mb']:.0f} MB" if res["peak_rss_mb"] else "")
                  + (", steps {steps:.0f} (rows {rows:.0f}, drafting {drafting_rows:.0f}) drafted {drafted:.0f} "
                     "accepted {accepted:.0f} prefilled {prefilled:.0f} caught up {caught_up:.0f} prefix hits "
                     "{prefix_hits:.0f}/{prefix_queries:.0f}".format(**res["steps"])
                     + ", seconds: " + " ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in res["steps"].items()
                                                if k.endswith("_s"))
                     if "steps" in res else ""), flush=True)
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
