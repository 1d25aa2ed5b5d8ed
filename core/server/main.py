"""`specpilot serve`: load a deployment and a stored recipe, start the engine thread, serve HTTP on uvicorn.

Shutdown drains: the first SIGTERM or SIGINT turns new and queued requests away with 503 while the requests in
flight finish, for at most `--grace` seconds; what is still running then ends with an error event, and the process
exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn

from specpilot.core.engine.decode import Verification
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.ram_budget import GB, HEADROOM, available_bytes, require
from specpilot.core.recipe import Recipe
from specpilot.core.recipe_source import serving_recipe

log = logging.getLogger("specpilot.serve")


def kv_budget(args: argparse.Namespace, rows_need: int) -> tuple[int, int]:
    """The KV budget in bytes and the prefix cache's part of it. By default room for every row at full length
    (`rows_need`) and a prefix cache of a quarter of that (at most 1 GiB), or what is available beside the
    models when that is less; a budget asked for must be available."""
    if args.prefix_cache_memory is not None:
        prefix = int(args.prefix_cache_memory * GB)
    if args.kv_cache_memory is not None:
        budget = int(args.kv_cache_memory * GB)
        require(budget, f"--kv-cache-memory {args.kv_cache_memory:g}", "lower --kv-cache-memory")
        if args.prefix_cache_memory is None:
            prefix = min(budget // 4, GB)
    else:
        if args.prefix_cache_memory is None:
            prefix = min(rows_need // 4, GB)
        avail = available_bytes()
        budget = rows_need + prefix if avail is None else min(rows_need + prefix, int(HEADROOM * avail))
    if prefix >= budget:
        raise ModelLoadError(f"a prefix cache of {prefix / GB:.2f} GiB leaves nothing of the KV budget "
                             f"({budget / GB:.2f} GiB) for the requests; lower --prefix-cache-memory or raise "
                             "--kv-cache-memory")
    return budget, prefix


def build(args: argparse.Namespace):
    """Everything `serve` runs, built before the port opens: a bad option is a one-line error, not a server
    that answers 500 to everything."""
    from transformers import AutoTokenizer

    from specpilot.core.deployment import Deployment
    from specpilot.core.engine import Engine
    from specpilot.core.server.app import ServerState, build_app
    from specpilot.core.server.engine_loop import EngineLoop
    from specpilot.core.server.metrics import Metrics

    deployment = Deployment.from_args(args).validate()
    deployment.apply_threads()
    recipe, speculative = serving_recipe(args.recipe, deployment, args.db)
    engine = Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                         deployment.numerics)
    target = engine.target if recipe is None else engine.target_for(recipe)
    ctx = target.cfg.max_position_embeddings
    context = min(args.max_model_len or min(ctx, 4096), ctx)
    rows = args.max_batch
    per_token = target.kv_bytes_per_token()
    if speculative and engine.drafter_model is not None:
        per_token += engine.drafter_model.kv_bytes_per_token()
    budget, prefix = kv_budget(args, rows * (context + 128) * per_token)  # + a step's tree and page slack
    default = Verification.of(recipe.verify if recipe is not None else None, speculative=False)
    if recipe is not None and recipe.verify.sampling != "greedy":  # requests choose: each is verified as it asks
        recipe = recipe.replace(verify={"sampling": "greedy"})
    table = None
    if speculative and recipe.batching.policy != "fixed":  # price steps at the batch sizes a server sees
        table = engine.cost_table(recipe, sorted({b for b in (1, 2, 4, 8, 16, rows) if b <= rows}), stored=True,
                                  remeasure=args.remeasure)
        log.info("step costs for batching policy %r: %s", recipe.batching.policy, table.source)
    tokenizer = AutoTokenizer.from_pretrained(deployment.target)
    warm_up(engine, recipe, speculative, tokenizer)
    sched = engine.scheduler(recipe, rows, context, table, speculative=speculative,
                             token_budget=args.max_num_batched_tokens or None, prefix_cache_bytes=prefix,
                             kv_cache_bytes=budget - prefix)
    if sched.fits() < context:
        log.info("the KV budget holds requests of up to %d tokens (--max-model-len %d)", sched.fits(), context)
        context = sched.fits()
    log.info("KV budget %.2f GiB (prefix cache %.2f GiB), %s tokens a step", budget / GB, prefix / GB,
             args.max_num_batched_tokens or "unbounded")
    name = args.served_model_name or Path(deployment.target_source or deployment.target).name
    metrics = Metrics()
    loop = EngineLoop(sched, metrics, args.max_queue, on_error=log.error)
    label = ("ar" if recipe is None else f"ar+{recipe.name}") if not speculative else recipe.name
    state = ServerState(loop, tokenizer, (name,), context, default, set(target.cfg.eos_token_ids),
                        target.cfg.vocab_size, metrics, args.api_key,
                        info={"recipe": label, "deployment": deployment.describe(),
                              "numerics": deployment.numerics})
    return build_app(state), state, label, deployment


def warm_up(engine, recipe: Recipe | None, speculative: bool, tokenizer) -> None:
    """One short generation before the port opens, as llama-server's warm-up run does: the first request
    should not pay for building kernels, repacking blocks or faulting in the mapped weights (on the real pair
    under q8 that was 2.5 s of a 128-token request's 12.5)."""
    ids = tokenizer("def warm_up():").input_ids or [0]
    started = time.perf_counter()
    engine.generate([ids], 4, recipe, speculative=speculative)
    log.info("warmed up in %.1f s", time.perf_counter() - started)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; exit 0 after draining."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, state, label, deployment = build(args)
    state.engine.start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="off")
    server = DrainingServer(config, state, args.grace)
    log.info("serving %s with recipe %s on http://%s:%d (max batch %d, queue %d)", deployment.describe(), label,
             args.host, args.port, args.max_batch, args.max_queue)
    print(f"specpilot serve: ready on http://{args.host}:{args.port}/v1 ({label}, numerics {deployment.numerics})",
          file=sys.stderr, flush=True)
    server.run()
    state.engine.stop()
    log.info("stopped")
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on the first signal: 503 to new requests, in-flight ones finish within
    `grace` seconds, then a normal shutdown."""

    def __init__(self, config, state, grace: float) -> None:
        super().__init__(config)
        self.state, self.grace = state, grace
        self.deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.deadline is not None:
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self.state.draining = True
        self.deadline = time.monotonic() + self.grace
        self.state.engine.turn_away_queued("the server is shutting down and this request had not started; send it "
                                           "to another replica")
        log.info("%s: draining %d requests (at most %.0f s)", signal.Signals(sig).name,
                 self.state.engine.outstanding, self.grace)

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and not self.should_exit:
            if self.state.engine.outstanding == 0:
                self.should_exit = True
            elif time.monotonic() > self.deadline:
                log.warning("grace period over: ending %d requests", self.state.engine.outstanding)
                self.state.engine.abort_all()
                self.deadline = float("inf")
        return await super().on_tick(counter)
