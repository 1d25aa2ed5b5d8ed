"""`python scripts/headline.py [--requests 8] [--threads 1] [--llama-server PATH]` (after `specpilot fetch
qwen-coder`): the headline table of docs/RESULTS.md in one run, on the real pair and the same coding_chat
requests (128 tokens, greedy, prompt included); with `--reference`, llama.cpp's texts are compared with
transformers' too:

- transformers' greedy decoding (hf-ar) and its assisted generation with the 0.5B drafter (hf-assisted), our
  AR on the GGUF blocks (ar+gguf) and the best recipe, stock-gguf-q4: `specpilot bench`, with every output
  compared with hf-ar's;
- llama.cpp's `llama-server` on the same GGUF files, plain and with its draft model (`-md`, `--spec-draft-n-max 4`),
  one request at a time through its chat endpoint (`scripts/load.py --concurrency 1`).

Prints one markdown table: tok/s, and the speedup over hf-ar.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def llama_server(binary: str, target: str, drafter: str | None, threads: int, requests: int, port: int,
                 reference: str | None) -> dict:
    argv = [binary, "-m", target, "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096",
            "--port", str(port), "--log-disable"]
    if drafter:
        argv += ["-md", drafter, "--spec-draft-n-max", "4", "--spec-draft-n-min", "0", "--draft-p-min", "0.0",
                 "-td", str(threads), "-tbd", str(threads)]
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        subprocess.run([sys.executable, str(REPO / "scripts" / "load.py"), "--serve", " ".join(argv), "--url",
                        f"http://127.0.0.1:{port}/v1", "--concurrency", "1", "--requests", str(requests),
                        "--max-tokens", "128", "--json", out.name, "--name", "llama-server"]
                       + (["--reference", reference] if reference else []), check=True)
        return json.loads(Path(out.name).read_text().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llama-server", default="llama-server")
    p.add_argument("--reference", default=None,
                   help="transformers' texts (scripts/load.py --make-reference) to count llama.cpp's drift against")
    args = p.parse_args()
    from specpilot.core.fetch import fetch

    paths = fetch("qwen-coder")
    bench = subprocess.run([str(REPO / ".venv" / "bin" / "specpilot"), "bench", "--target", paths["target"],
                            "--drafter", paths["drafter"], "--workload", str(REPO / "workloads" / "coding_chat.jsonl"),
                            "--recipes", "stock-gguf-q4", "--hf", "hf-ar,hf-assisted", "--no-ar",
                            "--max-requests", str(args.requests), "--max-new-tokens", "128", "--repeats", "1",
                            "--threads", str(args.threads), "--quiet", "--json"],
                           capture_output=True, text=True, check=True)
    summary = json.loads(bench.stdout)
    rows = [(r["name"], r["tokens_per_s"], r.get("mismatched_requests")) for r in summary["results"]]
    for name, drafter, port in (("llama-server", None, 8411), ("llama-server -md (draft 4)", paths["drafter"], 8412)):
        res = llama_server(args.llama_server, paths["target"], drafter, args.threads, args.requests, port,
                           args.reference)
        rows.append((name, res["output_tok_per_s"], res.get("mismatches")))
    hf = next(t for n, t, _ in rows if n == "hf-ar")
    print(f"| system | tok/s | vs hf-ar | mismatched requests (of {args.requests}) |\n|---|---|---|---|")
    for name, tps, mism in rows:
        print(f"| {name} | {tps:.2f} | {tps / hf:.2f}x | {'-' if mism is None else mism} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
