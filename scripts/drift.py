"""`python scripts/drift.py [--requests 16] [--tokens 128] [--llama-server PATH] [--port P] [--json OUT]` (after
`specpilot fetch qwen-coder`; needs no network).

Quality of the q8 numerics, beside llama.cpp's, on the real target (Qwen2.5-Coder-1.5B-Instruct GGUF) and the
first coding_chat requests through its chat template (core/real_pair.py), everything on 1 thread:
(a) our q8 plain (AR) greedy decoding's tokens; (b) llama.cpp's greedy tokens on the same GGUF file and the
same templated prompt token ids (llama-server's native /completion, top_k 1, no prompt cache; its prompt is
checked to be exactly ours: same token count evaluated, so no extra BOS); (c) the drift of each from
transformers float32 (core/costmodel/drift.py: one teacher-forced float32 forward per request; a request
differs iff its greedy text differs from transformers'). Prints one markdown table, and how many of our q8
outputs equal llama.cpp's token for token.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from specpilot.core.costmodel.drift import drift, load_f32_reference
from specpilot.core.real_pair import load

LLAMA_SERVER = "/work/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc: subprocess.Popen, limit: float = 600) -> None:
    start = time.time()
    while time.time() - start < limit:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"llama-server not ready after {limit:.0f} s")


def llama_outputs(server: str, gguf: str, port: int, prompts: list[list[int]], tokens: int,
                  tokenizer) -> tuple[list[list[int]], list[str]]:
    """llama.cpp's greedy output tokens for each prompt (token ids in, token ids out), and notes on anything
    that is not that (a re-tokenised text, a prompt not evaluated as ours)."""
    argv = [server, "-m", gguf, "-t", "1", "-tb", "1", "-np", "1", "-c", "4096", "--port", str(port),
            "--host", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    notes: list[str] = []
    outs = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc)
        for i, ids in enumerate(prompts):
            res = post(base + "/completion", {"prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True})
            evaluated = res.get("tokens_evaluated")
            if evaluated is None:
                notes.append(f"request {i}: llama-server reported no tokens_evaluated: its prompt is unchecked")
            elif evaluated != len(ids):
                notes.append(f"request {i}: llama-server evaluated {evaluated} prompt tokens, ours are {len(ids)}")
            if res.get("tokens"):
                outs.append([int(t) for t in res["tokens"]])
            else:
                notes.append(f"request {i}: no \"tokens\" in llama-server's answer; its text re-tokenised with the "
                             "HF tokenizer (the tokens may not be the ones it chose)")
                outs.append(tokenizer.encode(res.get("content", ""), add_special_tokens=False))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return outs, notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request (greedy; fewer at an EOS)")
    p.add_argument("--llama-server", default=LLAMA_SERVER)
    p.add_argument("--port", type=int, default=None, help="llama-server's port (default: a free one)")
    p.add_argument("--json", default=None, help="write both drifts (Drift.to_dict()) and the outputs here")
    args = p.parse_args()

    from specpilot.core.engine import Engine, gguf_checkpoint

    pair = load(args.requests, threads=1, engine=False)  # torch on 1 thread
    target_dir = gguf_checkpoint.resolve(pair.target)
    prompts = pair.prompts
    t0 = time.time()
    engine = Engine.load(target_dir, None, numerics="q8")
    ours = [engine.generate([ids], args.tokens, None, speculative=False).tokens[0] for ids in prompts]
    del engine
    print(f"our q8 AR: {sum(map(len, ours))} tokens in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    t0 = time.time()
    theirs, notes = llama_outputs(args.llama_server, pair.target, args.port or free_port(), prompts, args.tokens,
                                  pair.tokenizer)
    print(f"llama.cpp: {sum(map(len, theirs))} tokens in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    t0 = time.time()
    reference = load_f32_reference(target_dir)
    drifts = {"ours, q8 AR": drift(reference, prompts, ours), "llama.cpp (llama-server)": drift(reference, prompts,
                                                                                                 theirs)}
    print(f"forcing against transformers float32: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    n = len(prompts)
    print(f"Drift from transformers float32: {n} coding_chat requests x {args.tokens} new tokens, greedy, "
          f"{pair.target.rsplit('/', 1)[-1]}\n")
    print("| system | requests differing | mismatching tokens / total (rate) | of which near-ties |")
    print("|---|---|---|---|")
    for name, d in drifts.items():
        print(f"| {name} | {d.differing} of {n} | {d.mismatches} / {d.tokens} ({100 * d.rate:.2f}%) | "
              f"{d.near_ties} |")
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"\nour q8 outputs equal to llama.cpp's token for token: {same} of {n}")
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
             for x, y in zip(ours, theirs) if x != y]
    if first:
        print(f"where they differ, first differing output position: {first}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": n, "tokens": args.tokens, "target": pair.target, "notes": notes,
                       "equal_to_llama_cpp": same, "drift": {k: d.to_dict() for k, d in drifts.items()},
                       "outputs": {"ours": ours, "llama.cpp": theirs}}, f)


if __name__ == "__main__":
    main()
