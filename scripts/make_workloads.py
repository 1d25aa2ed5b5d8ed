#!/usr/bin/env python
"""Build the demo workloads: ``workloads/code.jsonl`` and ``workloads/chat.jsonl``.

* code.jsonl - code-completion requests cut from the stdlib modules held out of the demo models'
  training corpus (``specpilot.core.demo_training.HELDOUT_MODULES``). For a function/method found with ``ast`` the
  prompt is the source from its ``def`` line through its docstring plus the first 1-2 non-blank
  lines of the body, then a cut into the following body line that never leaves a bare newline at
  the end: either mid-line, just before a space (a clean byte-level-BPE pre-token boundary), or,
  for lines without an inner space, right after that line's leading indentation.
* chat.jsonl - a round-robin sample over categories of Spec-Bench questions, format unchanged.

Deterministic: sorted candidates, ``random.Random(seed)`` selection.

Usage::

    python scripts/make_workloads.py --out workloads
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

from specpilot.core.demo_training import HELDOUT_MODULES, stdlib_dir

MAX_PROMPT_CHARS = 1200
MAX_NEW_TOKENS = 64
SPEC_BENCH = Path("/work/shared/data/spec_bench_question.jsonl")


def _functions(tree: ast.AST):
    """(qualname, node) for every function/method, in source order."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + child.name
                out.append((q, child))
                visit(child, q + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _cut_line(line: str, rng: random.Random) -> str:
    """A prefix of `line` (no trailing newline) that ends at a clean boundary."""
    body = line.rstrip("\n")
    stripped = body.lstrip(" \t")
    indent = body[: len(body) - len(stripped)]
    # positions of inner spaces (prefix ends right before a space => next pre-token starts with it)
    spaces = [i for i in range(len(indent) + 1, len(body)) if body[i] == " " and body[i - 1] != " "]
    if spaces:
        # prefer an early cut so the completion has work to do
        cut = spaces[rng.randrange(min(len(spaces), 2))]
        return body[:cut]
    return indent


def candidates(module: str, rng: random.Random) -> list[dict]:
    path = stdlib_dir() / module
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines(keepends=True)
    tree = ast.parse(src)
    mod = module[:-3]
    out = []
    for qual, node in _functions(tree):
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        if has_doc:
            header_end = body[0].end_lineno          # 1-based, inclusive
        else:
            header_end = body[0].lineno - 1
        if header_end < node.lineno:                 # one-liner "def f(): return x"
            continue
        start = node.lineno - 1
        k = rng.choice((1, 2))
        idx = header_end                             # 0-based index of the first line after the header
        taken = 0
        while idx < node.end_lineno and taken < k:
            if lines[idx].strip():
                taken += 1
            idx += 1
        # next non-blank line inside the function becomes the cut line
        while idx < node.end_lineno and not lines[idx].strip():
            idx += 1
        if taken < k or idx >= node.end_lineno:
            continue
        head = "".join(lines[start:idx])
        tail = _cut_line(lines[idx], rng)
        if not tail:                                 # cut line at column 0 (shouldn't happen in a body)
            continue
        prompt = head + tail
        if len(prompt) > MAX_PROMPT_CHARS or prompt.endswith("\n"):
            continue
        out.append({"id": f"{mod}:{qual}", "prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS,
                    "category": mod})
    # unique ids (e.g. property getter/setter pairs): keep the first
    seen, uniq = set(), []
    for r in out:
        if r["id"] not in seen:
            seen.add(r["id"])
            uniq.append(r)
    return uniq


def build_code(seed: int, n: int, per_module_cap: int) -> list[dict]:
    pools = {}
    for module in sorted(HELDOUT_MODULES):
        rng = random.Random(f"{seed}:{module}")
        pool = sorted(candidates(module, rng), key=lambda r: r["id"])
        random.Random(f"{seed}:pick:{module}").shuffle(pool)
        pools[module] = pool[:per_module_cap]
    # round-robin across modules so small modules still contribute
    chosen = []
    depth = 0
    while len(chosen) < n and any(depth < len(p) for p in pools.values()):
        for module in sorted(pools):
            if depth < len(pools[module]) and len(chosen) < n:
                chosen.append(pools[module][depth])
        depth += 1
    return sorted(chosen, key=lambda r: r["id"])


def build_chat(seed: int, n: int, source: Path = SPEC_BENCH) -> list[dict]:
    rows = [json.loads(l) for l in source.read_text().splitlines() if l.strip()]
    by_cat = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    for cat in by_cat:
        by_cat[cat].sort(key=lambda r: r["question_id"])
        random.Random(f"{seed}:{cat}").shuffle(by_cat[cat])
    chosen, depth = [], 0
    while len(chosen) < n:
        for cat in sorted(by_cat):
            if depth < len(by_cat[cat]) and len(chosen) < n:
                chosen.append(by_cat[cat][depth])
        depth += 1
    return sorted(chosen, key=lambda r: r["question_id"])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build workloads/code.jsonl and workloads/chat.jsonl")
    ap.add_argument("--out", default="workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-code", type=int, default=96)
    ap.add_argument("--per-module-cap", type=int, default=12)
    ap.add_argument("--n-chat", type=int, default=24)
    ap.add_argument("--spec-bench", default=str(SPEC_BENCH))
    args = ap.parse_args(argv)
    out = Path(args.out)
    code = build_code(args.seed, args.n_code, args.per_module_cap)
    write_jsonl(out / "code.jsonl", code)
    chat = build_chat(args.seed, args.n_chat, Path(args.spec_bench))
    write_jsonl(out / "chat.jsonl", chat)
    mods = defaultdict(int)
    for r in code:
        mods[r["category"]] += 1
    print(f"code.jsonl: {len(code)} requests ({dict(sorted(mods.items()))}); "
          f"max prompt {max(len(r['prompt']) for r in code)} chars")
    cats = defaultdict(int)
    for r in chat:
        cats[r["category"]] += 1
    print(f"chat.jsonl: {len(chat)} questions ({dict(sorted(cats.items()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
