#!/usr/bin/env python
"""Build ``workloads/coding_chat.jsonl``: coding requests for instruct models, in the chat format.

Five kinds of request a coding assistant gets, 12 of each: write (a function from its signature and
docstring summary), complete (a function cut after its docstring and first lines), explain, fix (a real
function with one seeded bug: a flipped comparison or an off-by-one), refactor. The code comes from
functions of the interpreter's standard library found with ``ast`` (6-40 lines, with a docstring, at most
1,500 characters), so prompts have realistic lengths (roughly 60-450 tokens with the chat template).
Every request has ``"chat": true`` (the model's chat template applies) and ``max_new_tokens`` 128.

Deterministic: sorted candidates and ``random.Random(seed)``.

Usage::

    python scripts/make_coding_chat.py --out workloads/coding_chat.jsonl
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

MODULES = ("textwrap", "shlex", "statistics", "fractions", "difflib", "heapq", "bisect", "calendar",
           "colorsys", "ipaddress", "string", "graphlib", "base64", "csv", "fnmatch", "glob", "gzip",
           "hmac", "imghdr", "netrc", "pprint", "quopri", "sched", "smtplib", "tabnanny", "uu", "wave",
           "zipapp", "ftplib", "mailbox", "mimetypes", "plistlib", "tokenize", "trace")
KINDS = ("write", "complete", "explain", "fix", "refactor")
PER_KIND = 12
MAX_NEW_TOKENS = 128
MAX_CHARS = 1500
FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def functions(stdlib: Path) -> list[tuple[str, str, ast.FunctionDef]]:
    """(id, source, node) of every top-level function or method that fits, sorted by id."""
    out = []
    for name in MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
                continue
            source = ast.get_source_segment(text, node)
            if source is None or node.name.startswith("__"):
                continue
            lines = source.count("\n") + 1
            if 6 <= lines <= 40 and len(source) <= MAX_CHARS and _has_bug_site(node):
                out.append((f"{name}:{node.name}:{node.lineno}", _dedent(source, node.col_offset), node))
    return sorted(out, key=lambda x: x[0])


def _dedent(source: str, pad: int) -> str:
    """A method's source moved to column 0 (ast's segment starts at `def`, the rest keep the class indent)."""
    lines = source.splitlines()
    rest = [ln[pad:] if ln[:pad].strip() == "" else ln for ln in lines[1:]]
    return "\n".join([lines[0], *rest])


def _has_bug_site(node: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Compare) and type(n.ops[0]) in FLIPS for n in ast.walk(node))


def with_bug(source: str, rng: random.Random) -> str:
    """The function with one comparison flipped (< to <=, == to !=, ...), re-rendered by ast."""
    tree = ast.parse(source)
    sites = [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and type(n.ops[0]) in FLIPS]
    site = rng.choice(sites)
    site.ops[0] = FLIPS[type(site.ops[0])]()
    return ast.unparse(tree)


def head(source: str, rng: random.Random) -> str:
    """The function through its docstring plus 1-2 body lines: what an editor sends for completion."""
    tree = ast.parse(source).body[0]
    doc_end = tree.body[0].end_lineno
    keep = doc_end + rng.choice((1, 2))
    return "\n".join(source.splitlines()[:keep])


def prompt(kind: str, source: str, node: ast.FunctionDef, rng: random.Random) -> str:
    fence = "```python\n{}\n```"
    if kind == "write":
        summary = ast.get_docstring(node).strip().split("\n\n")[0].replace("\n", " ")
        sig = source.splitlines()[0].rstrip(":")
        return (f"Write a Python function `{sig.removeprefix('def ')}`.\n{summary}\n"
                "Include a docstring and handle edge cases.")
    if kind == "complete":
        return "Complete the body of this Python function:\n" + fence.format(head(source, rng))
    if kind == "explain":
        return "Explain what this Python function does, step by step:\n" + fence.format(source)
    if kind == "fix":
        return ("This function has a bug. Find it, explain it in one sentence, and give the fixed function:\n"
                + fence.format(with_bug(source, rng)))
    return ("Refactor this function for readability (clear names, type hints, no behaviour change):\n"
            + fence.format(source))


def build(seed: int) -> list[dict]:
    rng = random.Random(seed)
    pool = functions(Path(sysconfig.get_paths()["stdlib"]))
    chosen = rng.sample(pool, PER_KIND * len(KINDS))
    rows = []
    for i, (fid, source, node) in enumerate(chosen):
        kind = KINDS[i % len(KINDS)]
        rows.append({"id": f"{kind}:{fid}", "prompt": prompt(kind, source, node, rng), "chat": True,
                     "max_new_tokens": MAX_NEW_TOKENS, "category": kind})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="workloads/coding_chat.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = build(args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {args.out}")


if __name__ == "__main__":
    main()
