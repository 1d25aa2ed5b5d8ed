"""The scheduler: continuous batching with batch-aware speculation; requests join and leave between steps.

`Scheduler` is the one decoding loop: `add` a request, `step` (admit what fits, one speculative step over every
row in flight, the new tokens per request, as `Event`s), `abort`. Its step is written once, in order: the
drafter catches up on what rows owe it, drafts, one target forward verifies every row's tree, the acceptance
rule walks each tree, the caches keep the accepted paths, and each request's new tokens are emitted by one set
of rules. A recipe's online scheduler is built by `Engine.scheduler`; `drive` runs one over a fixed list
(`Engine.serve`, what `bench --batch-sizes` measures); `generate` builds one for a fixed batch (the judge's
timings, forcing, the benches); an online server drives the same object from its engine thread.
Active requests stay packed in the first rows of the KV cache (a finished request's row is refilled by the
next queued prompt, or by the last active row), so every forward runs on exactly the active batch. How deep
each row drafts is its batching policy's choice (core/engine/batching.py). The policy is told, per row, how many
tokens the row owes the drafter (a model drafter reads a prompt only when its row is first drafted for, and
tokens emitted while nothing was drafted for it pile up) and how many it has left to generate, and prices the
catch-up that drafting for the row would take; a row given depth 0 is not caught up. The scheduler runs the
catch-up of the rows a step drafts for before the step, times it, and reports it to the policy
(Policy.observe_catch_up), which learns the catch-up's price from it rather than the step's.

With a token budget (`token_budget`, vLLM's max_num_batched_tokens) a step takes the decode and verify rows of
the running requests first and then chunks of waiting prompts up to the budget, as vLLM's chunked prefill does:
a long prompt is prefilled over several steps while the requests already decoding keep decoding. At most one
prompt is part-way at a time, in the row after the running ones. Drafts share the budget: with a prompt waiting,
the batching policy's depths are cut to what is left after every running row's own token and the block the
prompt advances by, and go to the rows most likely to accept them. With a prefix cache
(core/engine/prefix_cache.py) a prompt starts from the cached blocks it begins with. Under q8 both are exact:
every position computes the same bits however its prompt was cut, so the tokens equal those of a prompt
prefilled at once.

The KV caches are lazy (core/engine/model.py): a row takes memory for the positions its request writes and
gives it back when the request leaves. With a KV budget (`kv_cache_bytes`) each running request reserves its
prompt, its new tokens and a step's tree, in the target's cache and the drafter's, and a waiting prompt is
admitted only when its reservation fits beside theirs, so the caches stay within the budget under any load.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specpilot.core.engine.batching import (MAX_DEPTH, PRIOR_ACCEPTANCE, ClassAcceptance, Policy, acceptance_sample,
                                            next_alpha)
from specpilot.core.engine.decode import (AcceptanceRule, DraftLength, GenerateResult, GenerationError, StepStats,
                                          Verification, cache_room, commit_paths, draft_depth, drafter_room, emit,
                                          misfit, remember, sync, verify)
from specpilot.core.engine.drafters import Drafter, DraftMode, TreeSpec
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.prefix_cache import BLOCK, PrefixCache
from specpilot.core.engine.tree import DraftTree, chain_paths, truncate_tree
from specpilot.core.mechanisms import lookup


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


@dataclass
class Rows:
    """The requests holding cache rows, packed from row 0, and what a step reads and advances for each: its
    request id, its cache length, its root (the token its next step starts from), its acceptance estimate and
    the tokens it gained in its last steps (a draft-length policy's input). One object, so a row that moves
    or leaves moves or leaves in every field at once."""

    ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    recent: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def _fields(self) -> tuple[list, ...]:
        return self.ids, self.lengths, self.roots, self.alphas, self.recent

    def append(self, rid: int, length: int, root: int) -> None:
        """A request whose cache row holds `length` positions starts decoding from `root`."""
        for lst, value in zip(self._fields(), (rid, length, root, PRIOR_ACCEPTANCE, [])):
            lst.append(value)

    def move(self, src: int, dst: int) -> None:
        for lst in self._fields():
            lst[dst] = lst[src]

    def pop(self) -> None:
        for lst in self._fields():
            lst.pop()

    def clear(self) -> None:
        for lst in self._fields():
            lst.clear()


@dataclass
class _Partial:
    """The prompt being prefilled over several steps: its request and how many of its tokens the row holds."""

    rid: int
    done: int


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
        return each(trees, req, lengths, lambda rule: rule.choices, lambda rows: logits[rows])

    def packed(logits: torch.Tensor, trees: list, ver: Verification, req: torch.Tensor, lengths: list[int]) -> list:
        starts = [0]
        for t in trees:
            starts.append(starts[-1] + len(t))

        def nodes(rows: list[int]) -> torch.Tensor:
            return logits[torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rows])]

        return each(trees, req, lengths, lambda rule: rule.packed, nodes)

    def each(trees: list, req: torch.Tensor, lengths: list[int],
             how: Callable[[AcceptanceRule], Callable], take: Callable[[list[int]], torch.Tensor]) -> list:
        out: list = [None] * len(trees)
        for v, rule in rules.items():
            rows = [b for b, w in enumerate(vers) if w == v]
            picked = how(rule)(take(rows), [trees[b] for b in rows], v, req[rows], [lengths[b] for b in rows])
            for b, c in zip(rows, picked):
                out[b] = c
        return out

    every_packed = all(rule.packed is not None for rule in rules.values())
    return AcceptanceRule(choices, accepts.pop(), True, packed if every_packed else None)


class Scheduler:
    """The online form of continuous batching: `add` queues a request, `step` admits queued requests into
    free rows (prefilling their prompts) and runs one speculative step over every row in flight, `abort`
    drops a request and frees its row at once. Requests join and leave between steps; a request's tokens
    do not depend on what else is in flight. Not thread-safe: one thread drives it (the server's engine
    thread; `drive` below for a fixed list).

    `eos` overrides the target's end-of-sequence tokens (an empty set decodes to every request's limit).
    `generator` is for rules that are not batched (rejection sampling): every row draws from it in turn, so a
    request's tokens depend on the rows beside it, which only a fixed batch (`generate`) may accept."""

    def __init__(self, target: Transformer, drafter: Drafter | None, spec: TreeSpec | None,
                 policy: Policy | None = None, max_batch: int = 8, max_len: int | None = None,
                 verification: Verification | None = None, draft_length: DraftLength | None = None,
                 token_budget: int | None = None, prefix_cache_bytes: int = 0,
                 kv_cache_bytes: int | None = None, eos: set[int] | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.ver = verification or Verification()
        self.draft_length = draft_length  # per-row depth caps from recent acceptance
        self.generator = generator
        self.rule = lookup("acceptance", self.ver.sampling)
        self._check_rule(self.ver)
        self.target, self.spec, self.max_batch = target, spec, max_batch
        self.policy = policy or Policy()
        self.speculative = drafter is not None and spec is not None
        self.drafter = drafter if self.speculative else None
        self.ctx = target.cfg.max_position_embeddings
        self.max_len = min(max_len or self.ctx, self.ctx)  # prompt + new tokens a request may take
        nodes = max(spec.max_nodes, MAX_DEPTH) if self.speculative else 0
        room = self.max_len + cache_room(nodes)
        self.eos = set(target.cfg.eos_token_ids) if eos is None else set(eos)
        self.cache = target.new_cache(max_batch, room, lazy=True)
        self._drafter_room = room + drafter_room(nodes)
        self._room = cache_room(nodes)
        self._drafter_extra = cache_room(nodes) + drafter_room(nodes)  # the drafter's row: the target's, one tree ahead
        if self.drafter is not None:
            self.drafter.open(max_batch, self._drafter_room)
        self.queue: list[int] = []
        self.requests: dict[int, _Request] = {}
        self.running = Rows()
        self.steps: list[StepStats] = []  # every step's statistics, unless a hook takes them instead
        self.on_step: Callable[[StepStats], None] | None = None  # e.g. a server's metrics: it keeps no history
        self._next_id = 0
        self._chain_specs: dict[int, TreeSpec] = {}
        self.classes = ClassAcceptance()  # acceptance per draft class, for a drafter that classes its drafts
        self._step_classes: list[int | None] = []  # this step's rows' draft classes (None: the row's estimate)
        if token_budget is not None and token_budget < 1:
            raise GenerationError(f"a step's token budget must be at least 1 token, not {token_budget}")
        self.token_budget = token_budget  # None: a queued prompt is prefilled whole when it is admitted
        self.partial: _Partial | None = None
        self.prefix = self._prefix_caches(prefix_cache_bytes)
        self.prefilled = 0  # prompt tokens computed (not found in the prefix cache), since the start
        self.kv_budget = kv_cache_bytes
        if kv_cache_bytes is not None and self.fits() < 1:
            raise GenerationError(f"a KV budget of {kv_cache_bytes / 2**20:.0f} MiB holds no request at all; raise it")

    def add(self, prompt: list[int], max_new_tokens: int, seed_id: int | None = None,
            verification: Verification | None = None) -> int:
        """Queue a request; returns its id. A prompt that does not fit with its new tokens is refused.
        `verification` (default the scheduler's) lets one request sample seeded at its own temperature,
        top_p and seed beside greedy ones: only batched rules (greedy, seeded) are served."""
        ver = verification or self.ver
        self._check_rule(ver)
        if why := misfit(len(prompt), max_new_tokens, self.fits()):
            raise GenerationError(why)
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = _Request(list(prompt), max_new_tokens, rid if seed_id is None else seed_id, ver)
        self.queue.append(rid)
        return rid

    def _check_rule(self, ver: Verification) -> None:
        """Refuse a rule whose rows would draw from one shared generator, unless this is a fixed batch's
        scheduler (given that generator) and the rule is its own."""
        if lookup("acceptance", ver.sampling).batched or (self.generator is not None and ver == self.ver):
            return
        raise GenerationError(f"continuous batching serves greedy or seeded verification, not {ver.sampling!r}")

    @property
    def rows(self) -> list[int]:
        """The request id in each cache row, rows packed from 0."""
        return self.running.ids

    def _prefix_caches(self, nbytes: int) -> PrefixCache | None:
        """The target's prefix cache, and the drafter's, splitting `nbytes` by their KV bytes per token. A drafter
        (which an engine keeps across schedulers) keeps none from an earlier scheduler."""
        if nbytes <= 0:
            if self.drafter is not None:
                self.drafter.reuse_prefixes(None)
            return None
        target, drafter = self._kv_per_token()
        if self.drafter is not None:
            self.drafter.reuse_prefixes(PrefixCache(nbytes * drafter // (target + drafter)) if drafter else None)
        return PrefixCache(nbytes * target // (target + drafter))

    def _kv_per_token(self) -> tuple[int, int]:
        """KV bytes per position in the target's cache and in the drafter's (0 for a drafter without one)."""
        model = None if self.drafter is None else self.drafter.kv_model
        return self.target.kv_bytes_per_token(), 0 if model is None else model.kv_bytes_per_token()

    def _extra(self) -> int:
        """KV bytes a request reserves beyond its positions: a step's tree in each cache, and in each slab
        (layer, head, keys or values) the page its last positions share with nothing else."""
        target, drafter = self._kv_per_token()
        slabs = 2 * mmap.PAGESIZE * (self.target.num_layers * self.target.cfg.num_kv_heads)
        if drafter:
            model = self.drafter.kv_model
            slabs += 2 * mmap.PAGESIZE * model.num_layers * model.cfg.num_kv_heads
        return self._room * target + self._drafter_extra * drafter + slabs

    def reservation(self, tokens: int) -> int:
        """KV bytes a request of `tokens` positions (prompt and new tokens) reserves."""
        target, drafter = self._kv_per_token()
        return tokens * (target + drafter) + self._extra()

    def fits(self) -> int:
        """The most positions (prompt and new tokens) one request may take: the context, or what the KV budget
        holds when it holds less."""
        if self.kv_budget is None:
            return self.max_len
        target, drafter = self._kv_per_token()
        return max(0, min(self.max_len, (self.kv_budget - self._extra()) // (target + drafter)))

    @property
    def reserved(self) -> int:
        """KV bytes the requests holding rows have reserved."""
        rids = self.rows + ([self.partial.rid] if self.partial is not None else [])
        return sum(self._reserve(r) for r in rids)

    def _reserve(self, rid: int) -> int:
        req = self.requests[rid]
        return self.reservation(len(req.prompt) + req.limit)

    def is_queued(self, rid: int) -> bool:
        """Whether request `rid` waits for a row (added, not yet admitted)."""
        return rid in self.queue

    def abort(self, rid: int) -> bool:
        """Drop a queued or running request, freeing its row now; False if it is not (or no longer) here."""
        if rid in self.queue:
            self.queue.remove(rid)
            del self.requests[rid]
            return True
        if rid in self.rows:
            self._free(self.rows.index(rid))
            return True
        if self.partial is not None and self.partial.rid == rid:
            self.partial = None
            del self.requests[rid]
            self.cache.release_row(len(self.rows))
            return True
        return False

    @property
    def in_flight(self) -> int:
        """Requests holding a cache row: decoding, or part-way through their prompt."""
        return len(self.rows) + (self.partial is not None)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def idle(self) -> bool:
        return not self.rows and not self.queue and self.partial is None

    def step(self) -> list[Event]:
        """Prefill what the budget allows, then one step over every running row: each request's new tokens,
        and those that ended. A request whose prefill fails ends with an "error" event alone; a failed step
        ends every request in flight that way (their caches are no longer trustworthy) and the scheduler serves
        on."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            depths = self._depths()
            failed, prefilled = self._prefill(depths)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            if not self.rows:
                if prefilled:
                    self._record(StepStats(0.0, 0.0, 0.0, 0.0, 0, [], prefill_ms, prefilled))
                return failed
            if depths is not None:  # rows that joined in this step's prefill decode plainly in it: their
                depths = depths + [0] * (len(self.rows) - len(depths))  # drafter has not read their prompt yet
            try:
                return failed + self._step(t0, prefill_ms, prefilled, depths)
            except Exception as exc:
                return failed + self._fail_all(f"{type(exc).__name__}: {exc}")

    def _depths(self) -> list[int] | None:
        """The running rows' draft depths for this step, from the batching policy (None: the recipe's tree for
        every row), told what each row owes the drafter and has left to generate. Under a token budget the
        drafts share it with the prompts waiting for their prefill: they may take what is left after every
        row's own token and the block a waiting prompt advances by, so a full step drafts only where
        acceptance is highest, and prefill never stalls behind speculation."""
        self._step_classes = []
        if not self.speculative:
            return None
        if not self.rows:
            return [] if self.policy.per_row else None
        cap = None
        if self.token_budget is not None:
            cap = self.token_budget - len(self.rows)
            if self.partial is not None or (self.queue and len(self.rows) < self.max_batch):
                cap -= min(self.token_budget, BLOCK)
        owed = [self.drafter.owed(b) for b in range(len(self.rows))]
        left = [self.requests[rid].limit - len(self.requests[rid].out) for rid in self.rows]
        return self.policy.depths(self._alphas(), cap, owed=owed, left=left)

    def _alphas(self) -> list[float]:
        """Each running row's acceptance estimate for this step: its draft class's (ClassAcceptance) where the
        drafter classes the draft it would give the row now, else the row's own running estimate. A per-row
        policy reads these, so a row whose next draft is weak, or empty, is priced as such."""
        if not self.policy.per_row:
            return self.running.alphas
        self._step_classes = [self.drafter.draft_class(b) for b in range(len(self.rows))]
        return [a if c is None else self.classes.estimate(c)
                for a, c in zip(self.running.alphas, self._step_classes)]

    def _prefill(self, depths: list[int] | None) -> tuple[list[Event], int]:
        """Give waiting prompts rows and prefill them: whole without a token budget, else the chunks the budget
        leaves after the running rows' step (`depths`: their drafts; None, the recipe's tree each). Returns the
        requests that failed and the prompt tokens computed."""
        room = None
        if self.token_budget is not None:
            if depths is None:
                step_tokens = (1 + (self.spec.max_nodes if self.speculative else 0)) * len(self.rows)
            else:
                step_tokens = len(self.rows) + sum(depths)
            room = max(self.token_budget - step_tokens, min(self.token_budget, BLOCK))  # a block at least
        spent, failed = 0, []
        while room is None or spent < room:
            if self.partial is None:
                if not self.queue or len(self.rows) >= self.max_batch:
                    break
                if self.kv_budget is not None and self.reserved + self._reserve(self.queue[0]) > self.kv_budget:
                    break  # it waits for running requests to give their positions back
                self.partial = _Partial(self.queue.pop(0), 0)
            rid = self.partial.rid
            try:
                spent += self._prefill_some(None if room is None else room - spent)
            except Exception as exc:  # one request's failure must not stop the others
                self.partial = None
                del self.requests[rid]
                self.cache.release_row(len(self.rows))
                failed.append(Event(rid, [], "error", f"{type(exc).__name__}: {exc}"))
        self.prefilled += spent
        return failed, spent

    def _prefill_some(self, most: int | None) -> int:
        """Prefill up to `most` more tokens of the part-way prompt (all of it for None) in the row after the
        running ones; it joins them when done. Returns the tokens computed."""
        p, row = self.partial, len(self.rows)
        prompt = self.requests[p.rid].prompt
        body = prompt[:-1]  # the last prompt token is the first step's root
        if p.done == 0:
            self.cache.row(row).lengths.zero_()
            if self.prefix is not None:
                p.done = self.prefix.load(self.cache, row, self.prefix.match(body))
        take = len(body) - p.done if most is None else min(len(body) - p.done, most)
        self.target.extend_row(self.cache, row, body[p.done:p.done + take])
        p.done += take
        if p.done == len(body):
            if self.prefix is not None:
                self.prefix.store(self.cache, row, body)
            self.partial = None
            self._join(p.rid)
        return take

    def _fail_all(self, why: str) -> list[Event]:
        events = [Event(rid, [], "error", why) for rid in self.rows]
        for rid in self.rows:
            del self.requests[rid]
        for row in range(len(self.rows)):
            self.cache.release_row(row)
        self.running.clear()
        if self.drafter is not None:
            self.drafter.open(self.max_batch, self._drafter_room)
        return events

    def _join(self, rid: int) -> None:
        """A request whose prompt the next row holds starts decoding."""
        prompt = self.requests[rid].prompt
        if self.drafter is not None:
            self.drafter.admit(prompt)
        self.running.append(rid, len(prompt) - 1, prompt[-1])

    def _step(self, t0: float, prefill_ms: float, prefilled: int, depths: list[int] | None) -> list[Event]:
        """One step over every running row, in order: catch up, draft, verify, accept, commit; then each
        request's new tokens. `depths`: the batching policy's per row (None: the recipe's tree each)."""
        rows, n, dev = self.running, len(self.running), self.target.device
        view, everyone = self.cache.view(n), list(range(n))
        req_ids = torch.tensor([self.requests[r].seed_id for r in rows.ids])
        vers = [self.requests[r].ver for r in rows.ids]
        rule = self.rule if all(v == self.ver for v in vers) else mixed_rule(vers)
        active = [True] * n if depths is None else [d > 0 for d in depths]  # a row drafted nothing owes on
        drafting = self.speculative and any(active)
        catch_up_ms, caught_up = self._catch_up(active) if drafting else (0.0, 0)
        t1 = time.perf_counter()
        trees = self._draft(depths, active, req_ids) if drafting else [DraftTree.root(r) for r in rows.roots]
        sync(dev)
        t2 = time.perf_counter()
        choice = verify(self.target, view, trees, self.ver, req_ids, rows.lengths, rule)
        sync(dev)
        t3 = time.perf_counter()
        walked = [rule.accept(trees[b], choice[b], self.generator) for b in everyone]
        paths = [path for path, _ in walked]
        emitted = [[trees[b].tokens[i] for i in path] + [bonus] for b, (path, bonus) in enumerate(walked)]
        commit_paths(view, everyone, paths, rows.lengths)
        if self.drafter is not None:
            self.drafter.commit(everyone, paths, emitted)
        sync(dev)
        t4 = time.perf_counter()
        events = self._emit(trees, paths, emitted)
        t5 = time.perf_counter()
        if depths is not None:
            self.policy.observe(depths, (t5 - t1) * 1e3)
        host_ms = (t1 - t0 + t5 - t4) * 1e3 - prefill_ms - catch_up_ms
        self._record(StepStats((t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, host_ms,
                               sum(len(t) for t in trees), [len(e) for e in emitted], prefill_ms, prefilled,
                               catch_up_ms, caught_up, sum(len(t) > 1 for t in trees)))
        return events

    def _draft(self, depths: list[int] | None, active: list[bool], req_ids: torch.Tensor) -> list[DraftTree]:
        """Every row's tree: a chain of the policy's depth (`depths`), else the recipe's tree, cut per row by the
        draft-length policy when there is one; a root alone for a row not `active`."""
        spec, caps, ver = self.spec, depths, self.ver
        if depths is not None:
            spec = self._chain_specs.setdefault(max(depths), TreeSpec("static", chain_paths(max(depths))))
        elif self.draft_length is not None:
            caps = [draft_depth(self.draft_length, spec.depth_limit, r) for r in self.running.recent]
            spec = spec.shortened(max(caps))
        mode = DraftMode(ver.sampling, ver.temperature, ver.top_p, ver.seed, req_ids, self.generator)
        trees = self.drafter.draft(spec, mode, active)
        return trees if caps is None else [truncate_tree(t, d) for t, d in zip(trees, caps)]

    def _emit(self, trees: list[DraftTree], paths: list[list[int]], emitted: list[list[int]]) -> list[Event]:
        """What a step leaves each row, by the rules every request ends by: its next root, its recent window and
        acceptance estimate, its new tokens up to its EOS or limit; the requests that ended leave their rows."""
        rows, events, done = self.running, [], []
        for b, tokens in enumerate(emitted):
            rows.roots[b] = tokens[-1]
            rows.recent[b] = remember(rows.recent[b], len(tokens))
            drafted = max(trees[b].depths)
            if drafted:
                seen = acceptance_sample(len(paths[b]), drafted)
                rows.alphas[b] = next_alpha(rows.alphas[b], seen)
                if b < len(self._step_classes) and self._step_classes[b] is not None:
                    self.classes.observe(self._step_classes[b], seen)
            req = self.requests[rows.ids[b]]
            new, finish = emit(tokens, req.out, req.limit, self.eos)
            events.append(Event(rows.ids[b], new, finish))
            if finish:
                done.append(b)
        for b in sorted(done, reverse=True):
            self._free(b)
        return events

    def _catch_up(self, active: list[bool]) -> tuple[float, int]:
        """Feed the drafter what the `active` rows owe it, and report the owed tokens fed and the time taken to
        the policy, whose price for a catch-up it corrects (not in the step's time, which `observe` learns
        from: see Policy.observe). Returns the ms it took and the owed tokens it fed."""
        rows = range(len(self.running))
        owed = sum(self.drafter.owed(b) for b in rows)
        if owed:
            sync(self.target.device)
        t0 = time.perf_counter()
        self.drafter.catch_up(active=active)
        fed = owed - sum(self.drafter.owed(b) for b in rows)
        if fed > 0:
            sync(self.target.device)
        ms = (time.perf_counter() - t0) * 1e3
        if fed > 0:
            self.policy.observe_catch_up(fed, ms)
        return ms, max(fed, 0)

    def _record(self, stats: StepStats) -> None:
        if self.on_step is not None:
            self.on_step(stats)
        else:
            self.steps.append(stats)

    def _free(self, b: int) -> None:
        """Row b leaves: the last row moves into it, so the rows in flight stay packed from 0."""
        last = len(self.rows) - 1
        del self.requests[self.rows[b]]
        if b != last:
            self.cache.move_row(last, b)
            if self.drafter is not None:
                self.drafter.move(last, b)
            self.running.move(last, b)
        self.running.pop()
        if self.drafter is not None:
            self.drafter.drop_last()
        self.cache.release_row(last)
        if self.partial is not None:  # the part-way prompt follows the running rows down
            self.cache.move_row(last + 1, last)
            self.cache.release_row(last + 1)



def check_fits(target: Transformer, prompts: list[list[int]], limits: list[int]) -> None:
    """Refuse, naming the request, a list in which one prompt with its new tokens exceeds the context."""
    ctx = target.cfg.max_position_embeddings
    for i, (p, n) in enumerate(zip(prompts, limits)):
        if why := misfit(len(p), n, ctx):
            raise GenerationError(f"request {i}: {why}")


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


def generate(target: Transformer, drafter: Drafter | None, prompts: list[list[int]],
             max_new_tokens: int | list[int], spec: TreeSpec | None = None,
             verification: Verification | None = None, request_ids: list[int] | None = None,
             eos_token_ids: list[int] | None = None, draft_length: DraftLength | None = None) -> GenerateResult:
    """A fixed batch of requests through one Scheduler, all admitted at once, every row drafting `spec` (cut
    per row by `draft_length(depth, recent)` when given); `drafter=None` or `spec=None` is autoregressive
    decoding. `request_ids` seed sampling per request; `eos_token_ids` replaces the target's (an empty list
    decodes to every limit). Rejection sampling is served here, and only here: its rows draw from one
    generator seeded with the recipe's seed, which a fixed batch can share."""
    if not prompts:
        return GenerateResult([], [], 0.0)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    check_fits(target, prompts, limits)
    ver = verification or Verification()
    sched = Scheduler(target, drafter, spec, max_batch=len(prompts),
                      max_len=max(len(p) + n for p, n in zip(prompts, limits)), verification=ver,
                      draft_length=draft_length, eos=None if eos_token_ids is None else set(eos_token_ids),
                      generator=torch.Generator().manual_seed(ver.seed))
    return drive(sched, prompts, limits, request_ids)
