"""`specpilot`: the headless command line (bench, profile, verify, run, runs, show, export, train-demo)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from core.recipe import RecipeError


def deployment_options(p: argparse.ArgumentParser) -> None:
    """Options naming a deployment; anything left out is the shipped demo."""
    p.add_argument("--target", help="target checkpoint directory (default: models/demo-target)")
    p.add_argument("--drafter", help="drafter checkpoint directory (default: models/demo-drafter)")
    p.add_argument("--workload", help="JSONL request set (default: workloads/code.jsonl)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: bfloat16)")


def loop_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `specpilot run` and `specpilot-tui`."""
    deployment_options(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agents", default="local:4", help="e.g. local:4,claude:2")
    p.add_argument("--model", default="claude-sonnet-4-5", help="Claude model for claude agents")
    p.add_argument("--auto", action="store_true", help="approve candidates that pass every gate")
    p.add_argument("--db", default=None, help="SQLite store (default: $SPECPILOT_DB or ./store.db)")
    p.add_argument("--max-requests", type=int, default=None, help="cap requests per split (quicker rounds)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def db_path(args: argparse.Namespace) -> str:
    return args.db or os.environ.get("SPECPILOT_DB") or "store.db"


def _recipes(spec: str | None) -> list:
    from core.recipe import resolve

    return [resolve(s.strip()) for s in (spec or "").split(",") if s.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from core import bench
    from core.deployment import Deployment

    deployment = Deployment.from_args(args)
    recipes = _recipes(args.recipes)
    if args.batch_sizes:
        from core.batchbench import run_batched

        summary = run_batched(deployment, recipes, [int(b) for b in args.batch_sizes.split(",")], args.split,
                              args.max_requests, args.max_new_tokens, args.repeats, progress=not args.quiet)
    else:
        summary = bench.run(deployment, recipes, args.split, args.max_requests, args.max_new_tokens, args.repeats,
                            hf=not args.no_hf, progress=not args.quiet)
    print(json.dumps(summary, indent=2) if args.json else bench.table(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpilot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="side-by-side speed: transformers, our AR, recipes")
    deployment_options(b)
    b.add_argument("--split", default="all", choices=["tuning", "heldout", "all"])
    b.add_argument("--max-requests", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=None)
    b.add_argument("--recipes", default="stock", help="comma-separated built-in names or .toml files")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--batch-sizes", default=None, help="e.g. 1,4,8,16,32: batched AR vs recipes")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    for extra in EXTRA_COMMANDS:
        extra(sub)
    return parser


EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    """Entry point; expected failures print one line to stderr and exit 2, never a traceback."""
    from core.engine import GenerationError, ModelLoadError
    from core.workload import WorkloadError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ModelLoadError, GenerationError, WorkloadError, RecipeError, FileNotFoundError) as exc:
        print(f"specpilot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specpilot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
