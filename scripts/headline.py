"""`python scripts/headline.py [--requests 8] [--threads 1] [--llama-server PATH] [--numerics f32|q8]` (after
`specpilot fetch qwen-coder`): a headline table of docs/RESULTS.md in one run, on the real pair and the same
coding_chat requests (128 tokens, greedy, prompt included).

`--numerics f32` (default; with `--reference`, llama.cpp's texts are compared with transformers' too):
- transformers' greedy decoding (hf-ar) and its assisted generation with the 0.5B drafter (hf-assisted), our
  AR on the GGUF blocks (ar+gguf) and the best recipe, stock-gguf-q4: `specpilot bench`, with every output
  compared with hf-ar's;
- llama.cpp's `llama-server` on the same GGUF files, plain and with its draft model (`-md`, `--spec-draft-n-max 4`),
  one request at a time through its chat endpoint (`scripts/load.py --concurrency 1`).

`--numerics q8 [--recipe R] [--llama-bench PATH]`: every system at llama.cpp's arithmetic family, one request at a
time through its server's chat endpoint (scripts/load.py, end to end: prompt included), llama-server plain,
with its draft model (`-md`) and with `--spec-type ngram-mod`, and `specpilot serve --numerics q8` with plain
decoding (`ar`) and with the recipe; beside it decoding alone (prompt excluded): llama-server's own timings,
and ours from scripts/peer_q8.py (which also runs llama-bench's AR). Each speculative system's texts are
compared with its own plain decoding's: ours must equal them, llama.cpp promises nothing.

Prints one markdown table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPECPILOT = str(REPO / ".venv" / "bin" / "specpilot")


def served(argv: list[str], name: str, port: int, requests: int, reference: str | None = None) -> dict:
    """One server (started, loaded with `requests` chat requests one at a time, stopped): scripts/load.py's
    result line, with the texts."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        subprocess.run([sys.executable, str(REPO / "scripts" / "load.py"), "--serve", " ".join(argv), "--url",
                        f"http://127.0.0.1:{port}/v1", "--concurrency", "1", "--requests", str(requests),
                        "--max-tokens", "128", "--json", out.name, "--name", name]
                       + (["--reference", reference] if reference else []), check=True)
        return json.loads(Path(out.name).read_text().splitlines()[-1])


def llama_argv(binary: str, target: str, threads: int, port: int, mode: list[str]) -> list[str]:
    return [binary, "-m", target, "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096",
            "--port", str(port), "--log-disable", *mode]


def draft_mode(drafter: str, threads: int) -> list[str]:
    return ["-md", drafter, "--spec-draft-n-max", "4", "--spec-draft-n-min", "0", "--draft-p-min", "0.0",
            "-td", str(threads), "-tbd", str(threads)]


def f32_headline(args: argparse.Namespace, paths: dict) -> int:
    bench = subprocess.run([SPECPILOT, "bench", "--target", paths["target"],
                            "--drafter", paths["drafter"], "--workload", str(REPO / "workloads" / "coding_chat.jsonl"),
                            "--recipes", "stock-gguf-q4", "--hf", "hf-ar,hf-assisted", "--no-ar",
                            "--max-requests", str(args.requests), "--max-new-tokens", "128", "--repeats", "1",
                            "--threads", str(args.threads), "--quiet", "--json"],
                           capture_output=True, text=True, check=True)
    summary = json.loads(bench.stdout)
    rows = [(r["name"], r["tokens_per_s"], r.get("mismatched_requests")) for r in summary["results"]]
    for name, mode, port in (("llama-server", [], 8411),
                             ("llama-server -md (draft 4)", draft_mode(paths["drafter"], args.threads), 8412)):
        res = served(llama_argv(args.llama_server, paths["target"], args.threads, port, mode), "llama-server", port,
                     args.requests, args.reference)
        rows.append((name, res["output_tok_per_s"], res.get("mismatches")))
    hf = next(t for n, t, _ in rows if n == "hf-ar")
    print(f"| system | tok/s | vs hf-ar | mismatched requests (of {args.requests}) |\n|---|---|---|---|")
    for name, tps, mism in rows:
        print(f"| {name} | {tps:.2f} | {tps / hf:.2f}x | {'-' if mism is None else mism} |")
    return 0


def q8_headline(args: argparse.Namespace, paths: dict) -> int:
    ours = ["--target", paths["target"], "--drafter", paths["drafter"], "--numerics", "q8",
            "--threads", str(args.threads)]
    systems = [("llama-server", llama_argv(args.llama_server, paths["target"], args.threads, 8411, []), 8411),
               ("llama-server -md (draft 4)", llama_argv(args.llama_server, paths["target"], args.threads, 8412,
                                                         draft_mode(paths["drafter"], args.threads)), 8412),
               ("llama-server --spec-type ngram-mod", llama_argv(args.llama_server, paths["target"], args.threads,
                                                                 8413, ["--spec-type", "ngram-mod"]), 8413),
               ("specpilot serve, q8 AR", [SPECPILOT, "serve", *ours, "--recipe", "ar", "--port", "8414"], 8414),
               (f"specpilot serve, q8 {args.recipe}", [SPECPILOT, "serve", *ours, "--recipe", args.recipe,
                                                       "--port", "8415"], 8415)]
    results = {name: served(argv, name, port, args.requests) for name, argv, port in systems}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(REPO / "scripts" / "peer_q8.py"), "--prompts", str(args.requests),
                        "--tokens", "128", "--rounds", "1", "--recipes", args.recipe, "--llama-bench",
                        args.llama_bench, "--json", out.name], check=True)
        alone = json.loads(Path(out.name).read_text())
    rate = alone["tok_per_s"]
    decode = {"llama-server": results["llama-server"]["decode_tok_per_s"],
              "specpilot serve, q8 AR": rate["ours q8 AR"],
              f"specpilot serve, q8 {args.recipe}": rate[f"ours q8 {args.recipe}"]}
    plain = {"llama-server -md (draft 4)": "llama-server", "llama-server --spec-type ngram-mod": "llama-server",
             f"specpilot serve, q8 {args.recipe}": "specpilot serve, q8 AR"}
    e2e_peer = max(r["output_tok_per_s"] for n, r in results.items() if n.startswith("llama-server"))
    alone_peer = max(r["decode_tok_per_s"] or 0.0 for n, r in results.items() if n.startswith("llama-server"))
    alone_peer = max(alone_peer, rate["llama.cpp AR"])
    print(f"| system | end to end tok/s | vs faster llama-server | decoding alone tok/s | vs faster llama.cpp "
          f"| requests differing from its own plain decoding (of {args.requests}) |\n|---|---|---|---|---|---|")
    print(f"| llama.cpp AR (llama-bench tg128) | - | - | {rate['llama.cpp AR']:.2f} | "
          f"{rate['llama.cpp AR'] / alone_peer:.2f}x | - |")
    for name, res in results.items():
        dec = decode.get(name) or res["decode_tok_per_s"]
        base = results.get(plain.get(name, ""), {}).get("texts")
        differ = "-" if base is None else sum(res["texts"][k] != base[k] for k in res["texts"])
        print(f"| {name} | {res['output_tok_per_s']:.2f} | {res['output_tok_per_s'] / e2e_peer:.2f}x | "
              f"{dec:.2f} | {dec / alone_peer:.2f}x | {differ} |")
    print(f"decoding alone, our q8 {args.recipe} against q8 AR's tokens: "
          f"{alone['differing'][args.recipe]} of {args.requests} differ")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llama-server", default="llama-server")
    p.add_argument("--llama-bench", default="llama-bench", help="q8: llama-bench for llama.cpp's AR decoding alone")
    p.add_argument("--numerics", default="f32", choices=("f32", "q8"))
    p.add_argument("--recipe", default="stock-gguf-q4", help="q8: our recipe (a built-in name or a .toml file)")
    p.add_argument("--reference", default=None,
                   help="f32: transformers' texts (scripts/load.py --make-reference) to count llama.cpp's drift against")
    args = p.parse_args()
    from specpilot.core.fetch import fetch

    paths = fetch("qwen-coder")
    return (q8_headline if args.numerics == "q8" else f32_headline)(args, paths)


if __name__ == "__main__":
    sys.exit(main())
