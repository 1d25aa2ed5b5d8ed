"""Engine checks on a CUDA machine: losslessness against transformers and batched speedups, float32.

Why a script of its own: the CLI's entry point opens the SQLite store (sqlmodel), which a bare GPU image
may lack; these checks need only the engine. A smoke pass (2 requests, 8 tokens) runs first, so a broken
path fails in seconds instead of after the full runs.

  python3 scripts/gpu_engine_check.py OUT_DIR [--requests 32] [--repeats 2] [--batch-sizes 1,4,8,16,32]
      [--policies budget,allocate,cap] [--no-lossless]

Writes OUT_DIR/lossless.json and OUT_DIR/batched.json and prints both tables (docs/RESULTS.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path


import torch

from specpilot.core import bench
from specpilot.core.batchbench import run_batched
from specpilot.core.deployment import Deployment
from specpilot.core.recipe import BatchingSection, RecipeError, builtin


def recipes(policies: tuple[str, ...] = ("budget",)) -> list:
    """Stock and the n-gram tree under the fixed (stock) policy; stock under the budget policy and the n-gram
    tree under each of `policies`."""
    def under(name: str, policy: str):
        recipe = dataclasses.replace(builtin(name), name=f"{name}-{policy}", batching=BatchingSection(policy=policy))
        return recipe.validate()
    return [builtin("stock"), under("stock", "budget"), builtin("ngram-tree"),
            *(under("ngram-tree", p) for p in policies)]


def single() -> list:
    """What the single-request run compares with transformers: stock and the n-gram tree."""
    return [builtin("stock"), builtin("ngram-tree")]


def batch_sizes(text: str) -> list[int]:
    """`--batch-sizes 1,4,16`: positive integers, or a one-line usage error."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers, e.g. 1,4,16")
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", type=batch_sizes, default="1,4,8,16,32")
    ap.add_argument("--policies", default="budget", help="batching policies for the n-gram tree (budget,allocate,cap)")
    ap.add_argument("--no-lossless", action="store_true", help="skip the single-request run against transformers")
    ap.add_argument("--device", default="cuda", help="cpu runs the same flow here (to check the script)")
    args = ap.parse_args()
    try:
        systems = recipes(tuple(args.policies.split(",")))
    except RecipeError as e:
        ap.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipping the engine GPU check")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(device=args.device, dtype="float32")
    deployment.apply_threads()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    try:
        t = time.perf_counter()
        run_batched(deployment, recipes(), [1, 2], max_requests=2, max_new_tokens=8, repeats=1, progress=False)
        bench.run(deployment, single(), max_requests=2, max_new_tokens=8, repeats=1, progress=False)
        print(f"smoke passed in {time.perf_counter() - t:.1f} s", flush=True)
    except Exception:
        traceback.print_exc()
        return 1
    t = time.perf_counter()
    batched = run_batched(deployment, systems, args.batch_sizes, max_requests=args.requests,
                          repeats=args.repeats, progress=False)
    (args.out / "batched.json").write_text(json.dumps(batched, indent=2))
    print(f"batched ({time.perf_counter() - t:.0f} s):\n{bench.table(batched)}", flush=True)
    if args.no_lossless:
        return 0
    t = time.perf_counter()
    lossless = bench.run(deployment, single(), max_requests=min(args.requests, 16), repeats=1, progress=False)
    (args.out / "lossless.json").write_text(json.dumps(lossless, indent=2))
    print(f"single request against transformers ({time.perf_counter() - t:.0f} s):\n{bench.table(lossless)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
