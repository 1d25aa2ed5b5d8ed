"""`LLAMA_BIN=/path/to/llama.cpp/build/bin python scripts/peer_llama_spec.py [prompts] [threads]` (after
`specpilot fetch qwen-coder`; llama-speculative-simple and llama-simple built there).

llama.cpp's speculative modes on the first coding requests (chat template applied, greedy, 128 new tokens):
decode tok/s and accepted drafts from its own report, and how far its output text stays equal to the float32
reference, which is our ar+gguf here (it equals transformers' greedy output on these requests: the
real-pair table in docs/RESULTS.md). Our stock-gguf-q4 is timed on the same prompts, decode only, request by
request after llama.cpp's modes so that both see the same load."""
import os
import re
import subprocess
import sys

from specpilot.core.real_pair import decode_seconds, load
from specpilot.core.recipe import builtin

NEW = 128


def llama(binary: str, args: list[str], prompt: str) -> tuple[str, str]:
    """(generated text, stderr) of one greedy llama.cpp run; the generated text is what follows the echoed
    prompt on stdout."""
    flag = [] if binary == "llama-simple" else ["-p"]  # llama-simple takes the prompt as its last argument
    path = os.path.join(os.environ.get("LLAMA_BIN", ""), binary)
    try:
        proc = subprocess.run([path, *args, *flag, prompt], capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        sys.exit(f"peer_llama_spec: no {path}; set LLAMA_BIN to llama.cpp's build/bin")
    if proc.returncode != 0:
        sys.exit(f"peer_llama_spec: {binary} failed: {proc.stderr.strip().splitlines()[-1:]}")
    out = proc.stdout
    at = out.find(prompt)
    if at < 0:
        sys.exit(f"peer_llama_spec: {binary} did not echo the prompt; cannot find its output")
    return out[at + len(prompt):].rstrip("\n"), proc.stderr


def same_tokens(tok, reference: list[int], text: str, capped: bool) -> int | None:
    """None when llama.cpp's text equals the reference's (or, for a reference cut at the token cap, starts
    with it: llama.cpp may stop a few tokens later); otherwise how many of the reference's tokens it
    reproduces before the first differing character."""
    ref = tok.decode(reference, skip_special_tokens=True)
    if text == ref or (capped and text.startswith(ref)):
        return None
    n = next((i for i, (a, b) in enumerate(zip(ref, text)) if a != b), min(len(ref), len(text)))
    return max(i for i in range(len(reference) + 1) if len(tok.decode(reference[:i], skip_special_tokens=True)) <= n)


def main() -> None:
    prompts, threads = (int(a) for a in (sys.argv[1:] + ["4", "1"])[:2])
    pair = load(prompts, threads=threads)
    target, draft, tok, eng = pair.target, pair.drafter, pair.tokenizer, pair.engine
    ar, q4 = builtin("stock-gguf"), builtin("stock-gguf-q4")
    common = ["-m", target, "-t", str(threads), "-n", str(NEW), "--temp", "0", "-c", "2048"]
    modes = {
        "llama.cpp AR": ("llama-simple", ["-m", target, "-n", str(NEW)]),
        "llama.cpp draft-simple (0.5B, 4)": ("llama-speculative-simple", [*common, "-md", draft, "--spec-type",
                                             "draft-simple", "--spec-draft-n-max", "4", "-td", str(threads)]),
        "llama.cpp ngram-simple": ("llama-speculative-simple", [*common, "--spec-type", "ngram-simple"]),
    }
    for r, ids in enumerate(pair.prompts):
        prompt = tok.decode(ids)
        reference = eng.generate([ids], NEW, ar, speculative=False).tokens[0]
        print(f"request {r}: {len(ids)} prompt tokens, reference {len(reference)} tokens", flush=True)
        for name, (binary, args) in modes.items():
            text, err = llama(binary, args, prompt)
            speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ s.*?speed:\s+([\d.]+) t/s", err)
            accept = re.search(r"accept\s+=\s+([\d.]+)%", err)
            same = same_tokens(tok, reference, text, len(reference) == NEW)
            print(f"  {name}: {float(speed.group(1)) if speed and binary != 'llama-simple' else '-'} tok/s, "
                  f"accepted {accept.group(1) + '%' if accept else '-'}, "
                  f"{'identical' if same is None else f'diverges after {same} tokens'}", flush=True)
        g = eng.generate([ids], NEW, q4)
        loop = decode_seconds(g)
        assert g.tokens[0] == reference, "stock-gguf-q4 differs from the reference"
        print(f"  ours stock-gguf-q4: {len(g.tokens[0]) / loop:.2f} tok/s, identical", flush=True)


if __name__ == "__main__":
    main()
