"""Continuous batching with batch-aware speculation: requests join and leave between steps.

`Scheduler` is the one serving path: `add` a request, `step` (admit what fits, one speculative step over every
row in flight, the new tokens per request), `abort`. `serve` drives it over a fixed list (what `bench
--batch-sizes` measures); an online server drives the same object from its engine thread.
Active requests stay packed in the first rows of the KV cache (a finished request's row is refilled by the
next queued prompt, or by the last active row), so every forward runs on exactly the active batch.
Batching policies (kind "batching" in core/mechanisms.py, looked up by name) decide each row's draft
depth per step:
  fixed     the recipe's tree for every row (stock behaviour);
  budget    one chain depth for all rows, chosen from the measured verification cost at the current batch
            size (down to 0: no speculation where it stops paying, with a 1-token probe step after
            PROBE_EVERY undrafted steps, then after twice as many each time a probe changes nothing, up
            to PROBE_MAX, so the rows' acceptance estimates stay current at a bounded cost; no probe
            where even the best acceptance would not draft);
  allocate  a shared per-step node budget spread over rows by their expected acceptance;
  cap       allocate under a cap on verified tokens per step at the bend of the cost curve.
On a `ragged` target (runtime.linear = "fused") verification computes only each row's real tree tokens, so
a step of per-row depths d costs the table's forward at the mean tokens per row, not at the deepest row's;
that is what lets allocate and cap give confident rows deeper drafts without every row paying for them.
A step's price is the table's forward and draft cost plus what real steps of that batch size and depth
cost beyond it (verification around the forward, commit, bookkeeping, a cache that is not warm), which
the policy measures as the run goes; a depth not yet tried is priced with the nearest one measured. Every
step pays the part that does not grow with depth, so it is what speculation amortises; the part that does
grow keeps wide steps from looking cheaper than they are.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from specpilot.core.engine.decode import (AcceptanceRule, DraftLength, GenerateResult, GenerationError, StepStats,
                                Verification, _cap, _truncate, cache_room, drafter_room, step, sync)
from specpilot.core.engine.drafters import Drafter, DraftMode, TreeSpec
from specpilot.core.engine.model import KVCache, Transformer
from specpilot.core.engine.tree import DraftTree, chain_paths
from specpilot.core.mechanisms import lookup

MAX_DEPTH = 8
PRIOR_ACCEPTANCE = 0.6
PROBE_EVERY = 16  # steps a policy may leave every row undrafted before one step drafts a token per row
PROBE_MAX = 128  # the longest wait between probes that keep finding drafting not worth it
ALPHA_MAX = 0.95  # the highest per-token acceptance a row's estimate can reach (samples are clipped to it)


@dataclass
class CostTable:
    """Measured ms of a target forward of `rows x tokens` and of a drafter forward of `rows x 1`."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)

    def verify_ms(self, rows: int, tokens: int) -> float:
        """Measured cost, or for an unmeasured batch size the nearest measured one scaled by rows."""
        if (rows, tokens) in self.verify:
            return self.verify[(rows, tokens)]
        measured_rows = sorted({r for r, _ in self.verify})
        near = min(measured_rows, key=lambda r: abs(r - rows))
        t = min(tokens, max(k for r, k in self.verify if r == near))
        return self.verify[(near, t)] * max(rows, 1) / near

    def step_ms(self, depths: list[int], ragged: bool) -> float:
        """Verification forward of one step whose rows draft `depths`: padded to the deepest row, or on a
        ragged target at the mean tokens per row (interpolated between the measured whole counts)."""
        rows = len(depths)
        if not ragged:
            return self.verify_ms(rows, max(depths) + 1)
        mean = sum(depths) / rows + 1
        lo = int(mean)
        low = self.verify_ms(rows, lo)
        if mean == lo:
            return low
        return low + (mean - lo) * (self.verify_ms(rows, lo + 1) - low)


def measure_costs(target: Transformer, drafter: Transformer | None, batch_sizes: list[int], max_depth: int = MAX_DEPTH,
                  context: int = 128, repeats: int = 5) -> CostTable:
    """Time forwards at every (batch size, 1..max_depth+1 tokens) so policies can price a step.

    The token counts of a batch size are timed in interleaved rounds (median per count): a policy compares
    depths by their ratio, and on a shared machine a slow spell that fell on one count's samples alone once
    priced 2 tokens per row at 2.4x one token (1.5x measured interleaved), so batch 16 never speculated."""
    table = CostTable()

    def timed(model: Transformer, cache: KVCache, rows: int, tokens: int) -> float:
        toks = torch.zeros(rows, tokens, dtype=torch.long, device=model.device)
        depths = torch.arange(tokens, device=model.device).expand(rows, tokens)
        anc = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool, device=model.device)).expand(rows, tokens, tokens)
        with torch.inference_mode():
            sync(model.device)
            t0 = time.perf_counter()
            model.step(toks, cache, cache.lengths, depths, anc)
            sync(model.device)
        return (time.perf_counter() - t0) * 1e3

    counts = range(1, max_depth + 2)
    for rows in batch_sizes:
        cache = target.new_cache(rows, context + max_depth + 2)
        cache.lengths.fill_(context)
        small = None if drafter is None else drafter.new_cache(rows, context + 2)
        if small is not None:
            small.lengths.fill_(context)
        samples: dict[int, list[float]] = {t: [] for t in counts}
        drafts: list[float] = []
        for round_ in range(repeats + 1):  # round 0 warms up
            for tokens in counts:
                ms = timed(target, cache, rows, tokens)
                if round_:
                    samples[tokens].append(ms)
            if small is not None:
                ms = timed(drafter, small, rows, 1)
                if round_:
                    drafts.append(ms)
        for tokens, ms in samples.items():
            table.verify[(rows, tokens)] = statistics.median(ms)
        if drafts:
            table.draft[rows] = statistics.median(drafts)
    return table


def acceptance_sample(accepted: int, drafted: int) -> float:
    """Per-token acceptance seen in one chain step: accepted tokens over the tokens the target tested (every
    accepted one, and the first rejected one unless the whole chain was accepted). The plain fraction
    accepted / drafted would read a 0.9-per-token drafter as 0.78 on chains of 4, and price deep chains out."""
    tested = accepted + 1 if accepted < drafted else drafted
    return accepted / tested


def expected_accepted(alpha: float, depth: int) -> float:
    """Tokens per step (bonus included) of a chain of `depth` with per-token acceptance `alpha`."""
    return sum(alpha ** k for k in range(depth + 1))


def best_uniform_depth(table: CostTable, rows: int, alpha: float, max_depth: int = MAX_DEPTH,
                       overhead_ms: dict[int, float] | None = None) -> int:
    """Depth maximising tokens per ms at this batch size (0 = plain decoding); `overhead_ms` maps a depth
    to what a step of it costs besides the table's forward and drafting (nearest measured depth if absent)."""
    seen = overhead_ms or {}

    def rate(d: int) -> float:
        extra = seen[min(seen, key=lambda k: (abs(k - d), k))] if seen else 0.0
        cost = table.verify_ms(rows, d + 1) + d * table.draft.get(rows, 0.0) + extra
        return expected_accepted(alpha, d) / cost
    return max(range(max_depth + 1), key=rate)


def allocate(alphas: list[float], nodes: int, max_depth: int = MAX_DEPTH) -> list[int]:
    """Spread `nodes` draft tokens over rows greedily by marginal expected acceptance alpha^(d+1)."""
    depths = [0] * len(alphas)
    for _ in range(max(0, nodes)):
        gains = [a ** (d + 1) if d < max_depth else -1.0 for a, d in zip(alphas, depths)]
        best = max(range(len(alphas)), key=lambda i: gains[i])
        if gains[best] <= 0:
            break
        depths[best] += 1
    return depths


def bend(table: CostTable, rows: int, max_depth: int = MAX_DEPTH) -> int:
    """Verified tokens per step where the cost curve bends: the widest step costing <= 1.5x one token."""
    one = table.verify_ms(rows, 1)
    fits = [t for t in range(1, max_depth + 2) if table.verify_ms(rows, t) <= 1.5 * one]
    return rows * max(fits)


@dataclass
class Policy:
    name: str = "fixed"
    spec: TreeSpec | None = None
    table: CostTable | None = None
    node_budget: int = 0
    token_cap: int = 0
    ragged: bool = False  # the target computes only real tree tokens (steps priced by their mean depth)
    overhead_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # rows -> depth -> ms
    idle: int = 0  # steps in a row that drafted nothing
    probe_every: int = PROBE_EVERY  # undrafted steps before the next probe

    def depths(self, alphas: list[float]) -> list[int] | None:
        """Per-row chain depths for this step, or None to use `spec` unchanged (the registered policy's).
        Rows that draft nothing learn nothing about their acceptance, so a policy that has drafted nothing
        for PROBE_EVERY steps gets one step of a single draft token per row: an early estimate that priced
        drafting out is corrected rather than kept for the rest of the run. No probe is taken where even the
        best acceptance an estimate can reach (ALPHA_MAX) would draft nothing at this batch size: a probe then
        could not change the answer, and it would feed the drafter every prompt it has been spared. A probe
        after which the policy still drafts nothing doubles the wait for the next one (up to PROBE_MAX), so
        where speculation truly does not pay (a wide batch) the probes cost less and less; drafting again
        resets the wait."""
        depths = lookup("batching", self.name)(self, alphas)
        if depths is None or max(depths, default=0) > 0:
            self.idle = 0
            self.probe_every = PROBE_EVERY
            return depths
        self.idle += 1
        if self.idle < self.probe_every or not self._could_draft(len(depths)):
            return depths
        self.idle = 0
        self.probe_every = min(2 * self.probe_every, PROBE_MAX)
        return [1] * len(depths)

    def _could_draft(self, rows: int) -> bool:
        """Whether drafting could pay at this batch size if every row's acceptance were ALPHA_MAX."""
        if self.table is None:
            return True
        return best_uniform_depth(self.table, rows, ALPHA_MAX, overhead_ms=self.overhead_ms.get(rows)) > 0

    def observe(self, depths: list[int], step_ms: float) -> None:
        """Learn what a step of this batch size and depth (the deepest draft; the mean one on a ragged
        target) costs beyond the table's price, from one whose rows drafted `depths` and took `step_ms`
        (admission and prefill excluded); a moving average per depth."""
        if self.table is None or self.name == "fixed":
            return
        rows, deepest = len(depths), max(depths)
        depth = round(sum(depths) / rows) if self.ragged else deepest
        priced = self.table.step_ms(depths, self.ragged) + deepest * self.table.draft.get(rows, 0.0)
        seen = max(0.0, step_ms - priced)
        known = self.overhead_ms.setdefault(rows, {})
        known[depth] = seen if depth not in known else 0.8 * known[depth] + 0.2 * seen


@dataclass
class Event:
    """What one scheduler step did for one request: the tokens it emitted (EOS included, nothing past the
    request's limit) and, once it is done, why: "stop" (EOS), "length" (max_new_tokens) or "error" (the
    engine failed on it; `error` says how, and the request is gone). An aborted request gets no event:
    `abort` ends it at once, in the caller's hands."""

    id: int
    tokens: list[int]
    finish: str | None = None
    error: str | None = None


@dataclass
class _Request:
    prompt: list[int]
    limit: int
    seed_id: int  # the id seeded sampling draws with (a request's tokens depend on it, never on its row)
    ver: Verification
    out: list[int] = field(default_factory=list)


def mixed_rule(vers: list[Verification]) -> AcceptanceRule:
    """One acceptance rule for a step whose rows verify differently (greedy beside seeded at its own
    temperature, top_p and seed): each group of rows gets its own rule's choices from the same forward.
    Drafting stays in the scheduler's mode for every row: a draft only proposes, so a row whose draft was
    ranked greedily and verified seeded still emits exactly its seeded tokens."""
    rules = {v: lookup("acceptance", v.sampling) for v in set(vers)}
    accepts = {r.accept for r in rules.values()}
    if len(accepts) != 1:
        raise GenerationError("requests in flight use acceptance rules that walk trees differently; serve them "
                              "from separate schedulers")

    def choices(logits: torch.Tensor, trees: list, ver: Verification, req: torch.Tensor, lengths: list[int]) -> list:
        out: list = [None] * len(trees)
        for v, rule in rules.items():
            rows = [b for b, w in enumerate(vers) if w == v]
            picked = rule.choices(logits[rows], [trees[b] for b in rows], v, req[rows], [lengths[b] for b in rows])
            for b, c in zip(rows, picked):
                out[b] = c
        return out

    return AcceptanceRule(choices, accepts.pop(), batched=True)


class Scheduler:
    """The online form of continuous batching: `add` queues a request, `step` admits queued requests into
    free rows (prefilling their prompts) and runs one speculative step over every row in flight, `abort`
    drops a request and frees its row at once. Requests join and leave between steps; a request's tokens
    do not depend on what else is in flight. Not thread-safe: one thread drives it (the server's engine
    thread; `serve` below for a fixed list)."""

    def __init__(self, target: Transformer, drafter: Drafter | None, spec: TreeSpec | None,
                 policy: Policy | None = None, max_batch: int = 8, max_len: int | None = None,
                 verification: Verification | None = None, draft_length: DraftLength | None = None) -> None:
        self.ver = verification or Verification()
        self.draft_length = draft_length  # per-row depth caps from recent acceptance, as in generate
        self.rule = lookup("acceptance", self.ver.sampling)
        if not self.rule.batched:
            raise GenerationError(f"continuous batching serves greedy or seeded verification, not "
                                  f"{self.ver.sampling!r}")
        self.target, self.spec, self.max_batch = target, spec, max_batch
        self.policy = policy or Policy()
        self.speculative = drafter is not None and spec is not None
        self.drafter = drafter if self.speculative else None
        self.ctx = target.cfg.max_position_embeddings
        self.max_len = min(max_len or self.ctx, self.ctx)  # prompt + new tokens a request may take
        nodes = max(spec.max_nodes, MAX_DEPTH) if self.speculative else 0
        room = self.max_len + cache_room(nodes)
        self.eos = set(target.cfg.eos_token_ids)
        self.cache = target.new_cache(max_batch, room)
        self._drafter_room = room + drafter_room(nodes)
        if self.drafter is not None:
            self.drafter.open(max_batch, self._drafter_room)
        self.queue: list[int] = []
        self.requests: dict[int, _Request] = {}
        self.rows: list[int] = []  # request id per cache row, rows packed from 0
        self.lengths: list[int] = []
        self.roots: list[int] = []
        self.alphas: list[float] = []
        self.recent: list[list[int]] = []  # per row: tokens gained in its last steps (the draft-length policy's input)
        self.steps: list[StepStats] = []
        self._next_id = 0
        self._chain_specs: dict[int, TreeSpec] = {}

    def add(self, prompt: list[int], max_new_tokens: int, seed_id: int | None = None,
            verification: Verification | None = None) -> int:
        """Queue a request; returns its id. A prompt that does not fit with its new tokens is refused.
        `verification` (default the scheduler's) lets one request sample seeded at its own temperature,
        top_p and seed beside greedy ones: only batched rules (greedy, seeded) are served."""
        ver = verification or self.ver
        if not lookup("acceptance", ver.sampling).batched:
            raise GenerationError(f"continuous batching serves greedy or seeded verification, not {ver.sampling!r}")
        if not prompt or max_new_tokens < 1:
            raise GenerationError("a request needs a non-empty prompt and max_new_tokens >= 1")
        if len(prompt) + max_new_tokens > self.max_len:
            raise GenerationError(f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} does not fit "
                                  f"the context of {self.max_len} tokens; shorten the prompt or lower max_new_tokens")
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = _Request(list(prompt), max_new_tokens, rid if seed_id is None else seed_id, ver)
        self.queue.append(rid)
        return rid

    def abort(self, rid: int) -> bool:
        """Drop a queued or running request, freeing its row now; False if it is not (or no longer) here."""
        if rid in self.queue:
            self.queue.remove(rid)
            del self.requests[rid]
            return True
        if rid in self.rows:
            self._free(self.rows.index(rid))
            return True
        return False

    @property
    def in_flight(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def idle(self) -> bool:
        return not self.rows and not self.queue

    def step(self) -> list[Event]:
        """Admit what fits, then one step over every row: each request's new tokens, and those that ended.
        A request whose prefill fails ends with an "error" event alone; a failed step ends every request in
        flight that way (their caches are no longer trustworthy) and the scheduler serves on."""
        t0 = time.perf_counter()
        failed: list[Event] = []
        with torch.inference_mode():
            while self.queue and len(self.rows) < self.max_batch:
                rid = self.queue.pop(0)
                try:
                    self._admit(rid)
                except Exception as exc:  # one request's failure must not stop the others
                    del self.requests[rid]
                    failed.append(Event(rid, [], "error", f"{type(exc).__name__}: {exc}"))
            if not self.rows:
                return failed
            try:
                return failed + self._step(t0)
            except Exception as exc:
                return failed + self._fail_all(f"{type(exc).__name__}: {exc}")

    def _fail_all(self, why: str) -> list[Event]:
        events = [Event(rid, [], "error", why) for rid in self.rows]
        for rid in self.rows:
            del self.requests[rid]
        for lst in (self.rows, self.lengths, self.roots, self.alphas, self.recent):
            lst.clear()
        if self.drafter is not None:
            self.drafter.open(self.max_batch, self._drafter_room)
        return events

    def _admit(self, rid: int) -> None:
        prompt = self.requests[rid].prompt
        self.target.prefill_row(self.cache, len(self.rows), prompt[:-1])
        if self.drafter is not None:
            self.drafter.admit(prompt)
        self.rows.append(rid)
        self.lengths.append(len(prompt) - 1)
        self.roots.append(prompt[-1])
        self.alphas.append(PRIOR_ACCEPTANCE)
        self.recent.append([])

    def _step(self, t0: float) -> list[Event]:
        n, ver, spec = len(self.rows), self.ver, self.spec
        view = self.cache.view(n)
        req_ids = torch.tensor([self.requests[r].seed_id for r in self.rows])
        depths = self.policy.depths(self.alphas) if self.speculative else None

        def draft() -> list[DraftTree]:
            if not self.speculative or (depths is not None and max(depths) == 0):
                return [DraftTree.root(r) for r in self.roots]
            step_spec, caps = spec, depths
            if depths is not None:
                step_spec = self._chain_specs.setdefault(max(depths), TreeSpec("static", chain_paths(max(depths))))
            elif self.draft_length is not None:
                caps = [_cap(self.draft_length, spec.depth_limit, self.recent[b]) for b in range(n)]
                step_spec = spec.shortened(max(caps))
            trees = self.drafter.draft(step_spec, DraftMode(ver.sampling, ver.temperature, ver.top_p, ver.seed,
                                                            req_ids), [True] * n)
            return trees if caps is None else [_truncate(t, d) for t, d in zip(trees, caps)]

        if self.speculative and (depths is None or max(depths) > 0):
            self.drafter.catch_up()  # admitted prompts and undrafted tokens: owed work, not this step's drafting
        vers = [self.requests[r].ver for r in self.rows]
        rule = self.rule if all(v == ver for v in vers) else mixed_rule(vers)
        taken = step(self.target, view, draft, self.drafter, list(range(n)), ver, rule, req_ids, self.lengths, None)
        events, done = [], []
        for b in range(n):
            self.roots[b] = taken.emitted[b][-1]
            self.recent[b] = (self.recent[b] + [len(taken.emitted[b])])[-16:]
            drafted = max(taken.trees[b].depths)
            if drafted:
                seen = acceptance_sample(len(taken.paths[b]), drafted)
                self.alphas[b] = 0.7 * self.alphas[b] + 0.3 * min(ALPHA_MAX, max(0.05, seen))
            req = self.requests[self.rows[b]]
            new, finish = [], None
            for t in taken.emitted[b]:
                new.append(t)
                req.out.append(t)
                if t in self.eos or len(req.out) >= req.limit:
                    finish = "stop" if t in self.eos else "length"
                    break
            events.append(Event(self.rows[b], new, finish))
            if finish:
                done.append(b)
        for b in sorted(done, reverse=True):
            self._free(b)
        t5 = time.perf_counter()
        if depths is not None:
            self.policy.observe(depths, (t5 - taken.start) * 1e3)
        self.steps.append(taken.stats((taken.start - t0 + t5 - taken.end) * 1e3))
        return events

    def _free(self, b: int) -> None:
        """Row b leaves: the last row moves into it, so the rows in flight stay packed from 0."""
        last = len(self.rows) - 1
        del self.requests[self.rows[b]]
        if b != last:
            self.cache.move_row(last, b)
            if self.drafter is not None:
                self.drafter.move(last, b)
            for lst in (self.rows, self.lengths, self.roots, self.alphas, self.recent):
                lst[b] = lst[last]
        for lst in (self.rows, self.lengths, self.roots, self.alphas, self.recent):
            lst.pop()
        if self.drafter is not None:
            self.drafter.drop_last()


def serve(target: Transformer, drafter: Drafter | None, prompts: list[list[int]], limits: list[int],
          spec: TreeSpec | None, policy: Policy | None = None, max_batch: int = 8,
          verification: Verification | None = None, request_ids: list[int] | None = None) -> GenerateResult:
    """Serve every request with at most `max_batch` in flight; outputs come back in request order."""
    check_fits(target, prompts, limits)
    sched = Scheduler(target, drafter, spec, policy, max_batch, max(len(p) + n for p, n in zip(prompts, limits)),
                      verification)
    return drive(sched, prompts, limits, request_ids)


def check_fits(target: Transformer, prompts: list[list[int]], limits: list[int]) -> None:
    """Refuse, naming the request, a list in which one prompt with its new tokens exceeds the context."""
    ctx = target.cfg.max_position_embeddings
    for i, (p, n) in enumerate(zip(prompts, limits)):
        if not p or len(p) + n > ctx:
            raise GenerationError(f"request {i}: prompt of {len(p)} tokens + max_new_tokens {n} does not fit the "
                                  f"model's context of {ctx} tokens; shorten the prompt or lower max_new_tokens")


def drive(sched: Scheduler, prompts: list[list[int]], limits: list[int],
          request_ids: list[int] | None = None) -> GenerateResult:
    """A fixed list of requests through a scheduler, all added at once; outputs in request order."""
    ids = request_ids if request_ids is not None else list(range(len(prompts)))
    start = time.perf_counter()
    order = {sched.add(p, n, i): k for k, (p, n, i) in enumerate(zip(prompts, limits, ids))}
    outputs: list[list[int]] = [[] for _ in prompts]
    while not sched.idle():
        for ev in sched.step():
            if ev.error:
                raise GenerationError(f"request {ids[order[ev.id]]}: {ev.error}")
            outputs[order[ev.id]].extend(ev.tokens)
    return GenerateResult(outputs, sched.steps, time.perf_counter() - start)
