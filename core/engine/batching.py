"""Batching policies: how deep each row of a batched step drafts, priced from measured step costs.

Batching policies (kind "batching" in core/mechanisms.py, registered at the end of this module, looked up by
name) decide each row's draft depth per step:
  fixed     the recipe's tree for every row (stock behaviour);
  budget    one chain depth for all rows (those worth drafting for, below), chosen from the measured
            verification cost at the current batch size (down to 0: no speculation where it stops paying,
            with a 1-token probe step after PROBE_EVERY undrafted steps, then after twice as many each time
            a probe changes nothing, up to PROBE_MAX, so the rows' acceptance estimates stay current at a
            bounded cost; no probe where even two fully accepted ones would leave the policy drafting nothing);
  allocate  a shared per-step node budget spread over rows by their expected acceptance;
  cap       allocate under a cap on verified tokens per step at the bend of the cost curve.
On a `ragged` target (runtime.linear = "fused", or any target under the q8 numerics, whose products of a token
do not depend on the rest of the pass) verification computes only each row's real tree tokens, so a step of
per-row depths d costs the table's forward at its real tokens, not at the deepest row's: fewer drafted tokens
than rows on the line from the measured step that drafts one (CostTable.first), more at the mean tokens per row;
that is what lets allocate and cap give confident rows deeper drafts, and the budget policy draft for some rows
only, without every row paying for them.
A step's price is the table's forward and draft cost plus what real steps of that batch size and depth
cost beyond it (verification around the forward, commit, bookkeeping, a cache that is not warm), which
the policy measures as the run goes; a depth not yet tried is priced with the nearest one measured. Every
step pays the part that does not grow with depth, so it is what speculation amortises; the part that does
grow keeps wide steps from looking cheaper than they are.

Drafting for a row also pays what the row owes the drafter (Drafter.owed): a model drafter reads a prompt
only when the row is first drafted for, and tokens emitted in steps that drafted nothing for it pile up,
so the first step that drafts for it feeds them all (ModelDrafter.catch_up). The policy prices that
catch-up at the table's `catch_up` ms per token, corrected by the catch-ups the scheduler times, and
spreads it over the tokens the row has left to generate, since once caught up the row drafts for the rest
of its life: a row owing o tokens with r left adds o * catch_up * E_d / r to a step of depth d > 0 (E_d
the tokens a step of depth d is expected to give it), nothing at depth 0. A row whose catch-up costs more
per token left than drafting could save it per token (`Policy.worth_drafting`) gets depth 0 from the
budget, allocate and cap policies, and the drafter leaves it owing; under load, where every new request
owes its whole prompt, that is what keeps speculation from paying a drafter prefill per request that it
never earns back. So does a row whose acceptance is below where drafting pays at this batch size.

A row's acceptance is its own running estimate, or where the drafter can class its next draft before drafting
(Drafter.draft_class: prompt lookup's match length) the estimate learned for that class across all rows
(ClassAcceptance): a wide step then drafts where the match is long and decodes plainly where it is not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specpilot.core.engine.decode import sync
from specpilot.core.engine.drafters import TreeSpec
from specpilot.core.engine.model import KVCache, Transformer
from specpilot.core.mechanisms import Preset, lookup, register

MAX_DEPTH = 8
PRIOR_ACCEPTANCE = 0.6
PROBE_EVERY = 16  # steps a policy may leave every row undrafted before one step drafts a token per row
PROBE_MAX = 128  # the longest wait between probes that keep finding drafting not worth it
ALPHA_MAX = 0.95  # the highest per-token acceptance a row's estimate can reach (samples are clipped to it)
MIN_GAIN = 0.10  # the least gain in tokens per ms over plain decoding a depth must promise to be drafted: the
# prices are measured and each row's acceptance is a running estimate, so a policy that drafts wherever they
# promise a few percent drafts mostly when an estimate is high by chance, and loses (the Xeon of docs/RESULTS.md:
# 0.98x plain decoding at batch 1, drafting on estimates that promised 3-15%)


CLASS_RATE = 0.05  # how far one drafted row's sample moves its draft class's shared estimate (ClassAcceptance)
CATCH_UP_TOKENS = 64  # the run of tokens measure_costs feeds one drafter row to price its catch-up per token


@dataclass
class CostTable:
    """Measured ms of a target forward of `rows x tokens`, of a drafter forward of `rows x 1`, and per token of
    a drafter forward fed a run of tokens in one row (`catch_up`: what ModelDrafter.catch_up does; None where
    it was not measured, see `catch_up_ms`). On a ragged target also `first`: a forward of `rows` rows where one
    row has 2 tokens, the step that drafts one token for one row. A kernel that multiplies rows in groups makes
    that token cost more than its even share of the way to `rows x 2` (the Xeon's q8 at 16 rows: 27 ms against
    9), and a policy that priced it by that share drafted a few tokens at a loss."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    source: str = ""  # where the prices came from, said to the user: measured now, or the file they were read from
    catch_up: float | None = None
    first: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The prices as JSON-able lists (core/engine/cost_store.py keeps them per deployment)."""
        out: dict = {"verify": [[r, t, ms] for (r, t), ms in sorted(self.verify.items())],
                     "draft": [[r, ms] for r, ms in sorted(self.draft.items())]}
        if self.catch_up is not None:
            out["catch_up"] = self.catch_up
        if self.first:
            out["first"] = [[r, ms] for r, ms in sorted(self.first.items())]
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "CostTable":
        """The table `to_dict` wrote; ValueError on anything else. A table kept before the catch-up price
        existed has none (catch_up None): it loads, and Engine.cost_table measures that price alone."""
        try:
            verify = {(int(r), int(t)): float(ms) for r, t, ms in data["verify"]}
            draft = {int(r): float(ms) for r, ms in data["draft"]}
            catch_up = None if data.get("catch_up") is None else float(data["catch_up"])
            first = {int(r): float(ms) for r, ms in data.get("first", [])}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a cost table ({type(exc).__name__}: {exc})") from None
        prices = [*verify.values(), *draft.values(), *first.values(), *([] if catch_up is None else [catch_up])]
        if not verify or any(ms <= 0 for ms in prices):
            raise ValueError("not a cost table (no prices, or a price that is not positive)")
        return cls(verify, draft, source, catch_up, first)

    def catch_up_ms(self) -> float:
        """ms per token the drafter owes a row: the measured price, or without one the cheapest measured drafter
        forward per token (as if each owed token took a one-token forward of its own: an upper bound, since a
        run of tokens shares the weights' reads, so a table without the price errs towards not drafting for rows
        that owe much); 0 with no drafter forward measured (prompt lookup owes nothing)."""
        if self.catch_up is not None:
            return self.catch_up
        return min(self.draft.values(), default=0.0)

    def verify_ms(self, rows: int, tokens: int) -> float:
        """Measured cost, or for an unmeasured batch size the nearest measured one scaled by rows."""
        if (rows, tokens) in self.verify:
            return self.verify[(rows, tokens)]
        measured_rows = sorted({r for r, _ in self.verify})
        near = min(measured_rows, key=lambda r: abs(r - rows))
        t = min(tokens, max(k for r, k in self.verify if r == near))
        return self.verify[(near, t)] * max(rows, 1) / near

    def draft_ms(self, rows: int) -> float:
        """ms of a drafter forward of `rows` x 1: measured, or for an unmeasured batch size interpolated between
        the measured ones around it (past the widest, that one scaled by rows); 0 with none measured (prompt
        lookup). An unmeasured width must not read as free: a policy once drafted at 7 and 13 rows, between the
        table's 4, 8 and 16, on drafts priced at nothing."""
        if not self.draft:
            return 0.0
        if rows in self.draft:
            return self.draft[rows]
        below = [r for r in self.draft if r < rows]
        above = [r for r in self.draft if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return self.draft[lo] + (rows - lo) * (self.draft[hi] - self.draft[lo]) / (hi - lo)
        near = max(below) if below else min(above)
        return self.draft[near] * rows / near if below else self.draft[near]

    def first_ms(self, rows: int) -> float | None:
        """ms of a ragged forward of `rows` rows, one of them 2 tokens deep: measured, or for an unmeasured
        batch size the plain forward plus what the nearest measured one paid for its extra token; None where
        none was measured (or for one row, where that is `rows x 2`)."""
        if rows < 2 or not self.first:
            return None
        if rows in self.first:
            return min(self.first[rows], self.verify_ms(rows, 2))
        near = min(self.first, key=lambda r: abs(r - rows))
        extra = self.first[near] - self.verify_ms(near, 1)
        return min(self.verify_ms(rows, 1) + max(0.0, extra), self.verify_ms(rows, 2))

    def step_ms(self, depths: list[int], ragged: bool) -> float:
        """Verification forward of one step whose rows draft `depths`: padded to the deepest row, or on a
        ragged target by its real tokens: up to `rows x 2` on the line from `first_ms` (one drafted token) to
        the whole count, past it at the mean tokens per row (interpolated between the measured whole counts)."""
        rows = len(depths)
        if not ragged:
            return self.verify_ms(rows, max(depths) + 1)
        drafted = sum(depths)
        first = self.first_ms(rows)
        if first is not None and 0 < drafted < rows:
            return first + (drafted - 1) * (self.verify_ms(rows, 2) - first) / (rows - 1)
        mean = drafted / rows + 1
        lo = int(mean)
        low = self.verify_ms(rows, lo)
        if mean == lo:
            return low
        return low + (mean - lo) * (self.verify_ms(rows, lo + 1) - low)


def measure_costs(target: Transformer, drafter: Transformer | None, batch_sizes: list[int], max_depth: int = MAX_DEPTH,
                  context: int = 128, repeats: int = 5) -> CostTable:
    """Time forwards at every (batch size, 1..max_depth+1 tokens) so policies can price a step, and on a ragged
    target the step where one row verifies one drafted token (CostTable.first).

    The token counts of a batch size are timed in interleaved rounds (median per count): a policy compares
    depths by their ratio, and on a shared machine a slow spell that fell on one count's samples alone once
    priced 2 tokens per row at 2.4x one token (1.5x measured interleaved), so batch 16 never speculated.
    The drafter's catch-up (one row fed CATCH_UP_TOKENS tokens from empty, as a fresh prompt is) is timed
    in the same rounds; its price is the median over every batch size's rounds, per token."""
    table = CostTable()

    def timed(model: Transformer, cache: KVCache, rows: int, tokens: int, sizes: list[int] | None = None) -> float:
        toks = torch.zeros(rows, tokens, dtype=torch.long, device=model.device)
        depths = torch.arange(tokens, device=model.device).expand(rows, tokens)
        anc = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool, device=model.device)).expand(rows, tokens, tokens)
        with torch.inference_mode():
            sync(model.device)
            t0 = time.perf_counter()
            model.step(toks, cache, cache.lengths, depths, anc, sizes=sizes, packed=sizes is not None)
            sync(model.device)
        return (time.perf_counter() - t0) * 1e3

    counts = range(1, max_depth + 2)
    row = None if drafter is None else drafter.new_cache(1, CATCH_UP_TOKENS)
    catch_ups: list[float] = []
    for rows in batch_sizes:
        cache = target.new_cache(rows, context + max_depth + 2)
        cache.lengths.fill_(context)
        small = None if drafter is None else drafter.new_cache(rows, context + 2)
        if small is not None:
            small.lengths.fill_(context)
        samples: dict[int, list[float]] = {t: [] for t in counts}
        drafts: list[float] = []
        firsts: list[float] = []
        for round_ in range(repeats + 1):  # round 0 warms up
            for tokens in counts:
                ms = timed(target, cache, rows, tokens)
                if round_:
                    samples[tokens].append(ms)
            if target.ragged and rows > 1:
                ms = timed(target, cache, rows, 2, [2] + [1] * (rows - 1))
                if round_:
                    firsts.append(ms)
            if small is not None:
                ms = timed(drafter, small, rows, 1)
                if round_:
                    drafts.append(ms)
                ms = _timed_catch_up(drafter, row)
                if round_:
                    catch_ups.append(ms)
        for tokens, ms in samples.items():
            table.verify[(rows, tokens)] = statistics.median(ms)
        if drafts:
            table.draft[rows] = statistics.median(drafts)
        if firsts:
            table.first[rows] = statistics.median(firsts)
    if catch_ups:
        table.catch_up = statistics.median(catch_ups) / CATCH_UP_TOKENS
    return table


def _timed_catch_up(drafter: Transformer, cache: KVCache) -> float:
    """ms of one drafter forward feeding CATCH_UP_TOKENS tokens to the empty row of `cache` (model.extend_row)."""
    cache.lengths.zero_()
    with torch.inference_mode():
        sync(drafter.device)
        t0 = time.perf_counter()
        drafter.extend_row(cache, 0, [0] * CATCH_UP_TOKENS)
        sync(drafter.device)
    return (time.perf_counter() - t0) * 1e3


def measure_catch_up(drafter: Transformer, repeats: int = 5) -> float:
    """The drafter's catch-up price alone (ms per token, as measure_costs times it): for a kept table measured
    before that price existed, so it is completed without timing the target again."""
    cache = drafter.new_cache(1, CATCH_UP_TOKENS)
    samples = [_timed_catch_up(drafter, cache) for _ in range(repeats + 1)][1:]  # the first warms up
    return statistics.median(samples) / CATCH_UP_TOKENS


def acceptance_sample(accepted: int, drafted: int) -> float:
    """Per-token acceptance seen in one chain step: accepted tokens over the tokens the target tested (every
    accepted one, and the first rejected one unless the whole chain was accepted). The plain fraction
    accepted / drafted would read a 0.9-per-token drafter as 0.78 on chains of 4, and price deep chains out."""
    tested = accepted + 1 if accepted < drafted else drafted
    return accepted / tested


def clipped(sample: float) -> float:
    """An acceptance sample as the estimates take it: within [0.05, ALPHA_MAX]."""
    return min(ALPHA_MAX, max(0.05, sample))


def next_alpha(alpha: float, sample: float) -> float:
    """A row's acceptance estimate after one drafted step whose sample (acceptance_sample) was `sample`: a moving
    average of clipped samples."""
    return 0.7 * alpha + 0.3 * clipped(sample)


@dataclass
class ClassAcceptance:
    """Per-token acceptance learned per draft class (Drafter.draft_class) across every row: where a drafter can
    tell before drafting how good a row's draft will be, the class predicts it better than the row's history (on
    the coding workload prompt lookup's continuations of a 3-token match were accepted ~0.85 a token and of a
    1-token match ~0.2, in the same rows). Class 0 (nothing to propose) is 0; an unseen class starts at
    PRIOR_ACCEPTANCE. Each drafted row's sample moves its class's estimate by CLASS_RATE, a slower average than a
    row's own (next_alpha) since a wide step brings many samples at once."""

    alphas: dict[int, float] = field(default_factory=dict)

    def estimate(self, cls: int) -> float:
        return 0.0 if cls == 0 else self.alphas.get(cls, PRIOR_ACCEPTANCE)

    def observe(self, cls: int, sample: float) -> None:
        """Learn from one drafted row of class `cls` whose acceptance_sample was `sample` (clipped as a row's)."""
        if cls == 0:
            return
        alpha = self.estimate(cls)
        self.alphas[cls] = alpha + CLASS_RATE * (clipped(sample) - alpha)


def expected_accepted(alpha: float, depth: int) -> float:
    """Tokens per step (bonus included) of a chain of `depth` with per-token acceptance `alpha`."""
    return sum(alpha ** k for k in range(depth + 1))


def step_price(table: CostTable, rows: int, depth: int, overhead_ms: dict[int, float] | None = None,
               drafting: int | None = None, ragged: bool = False) -> float:
    """ms of a step of `rows` whose `drafting` rows (default all) draft chains of `depth` and the others decode
    plainly: the table's forward (CostTable.step_ms: as wide as the deepest row, or on a `ragged` target the
    rows' real tokens alone) and drafting, plus `overhead_ms` (depth -> what a step of it costs besides them;
    the nearest measured depth if absent)."""
    seen = overhead_ms or {}
    extra = seen[min(seen, key=lambda k: (abs(k - depth), k))] if seen else 0.0
    m = rows if drafting is None else drafting
    return table.step_ms([depth] * m + [0] * (rows - m), ragged) + depth * table.draft_ms(rows) + extra


def best_uniform_depth(table: CostTable, rows: int, alpha: float, max_depth: int = MAX_DEPTH,
                       overhead_ms: dict[int, float] | None = None, owed_ms: float = 0.0,
                       drafting: int | None = None, ragged: bool = False) -> int:
    """Depth maximising tokens per ms at this batch size (0 = plain decoding); `overhead_ms` maps a depth
    to what a step of it costs besides the table's forward and drafting (nearest measured depth if absent).
    `owed_ms` is the drafting rows' catch-up per token each has left, summed (Policy.owed_ms): a step of depth
    d > 0 pays expected_accepted(alpha, d) times it, the catch-up spread over those rows' remaining tokens.
    `drafting` rows of the `rows` draft (default all); the others decode plainly, a token per step, in the
    same forward, which on a `ragged` target computes only their one token each (step_price). A depth that
    promises less than MIN_GAIN over plain decoding gives 0.
    """
    m = rows if drafting is None else drafting
    if m <= 0:
        return 0

    def rate(d: int) -> float:
        gained = expected_accepted(alpha, d)
        cost = step_price(table, rows, d, overhead_ms, m, ragged) + (gained * owed_ms if d else 0.0)
        if m < rows:
            gained = (m * gained + rows - m) / rows
        return gained / cost
    best = max(range(max_depth + 1), key=rate)
    return best if best == 0 or rate(best) >= (1 + MIN_GAIN) * rate(0) else 0


def break_even(table: CostTable, rows: int, depth: int) -> float | None:
    """The per-token acceptance from which `rows` rows, every one drafting a chain of `depth`, give as many tokens
    per ms as plain decoding at the table's prices alone (the drafter's catch-up and a step's overhead left out):
    the alpha where expected_accepted(alpha, depth) equals the step's price over a plain step's. None where even
    alpha = 1 would not: no drafter of this cost pays at that width and depth, however good its guesses."""
    need = step_price(table, rows, depth) / step_price(table, rows, 0)
    if need > depth + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, depth) < need else (lo, mid)
    return hi


def drafting_saves(table: CostTable, rows: int, alpha: float, max_depth: int = MAX_DEPTH,
                   overhead_ms: dict[int, float] | None = None) -> float:
    """ms of step time per token that drafting at its best depth saves a row of acceptance `alpha` at this
    batch size, against plain decoding (each row's share of a step, per token it gains): what its catch-up,
    per token it has left, must stay under for drafting to pay for it. <= 0 where drafting does not pay."""
    plain = step_price(table, rows, 0, overhead_ms) / rows
    return max((plain - step_price(table, rows, d, overhead_ms) / (rows * expected_accepted(alpha, d))
                for d in range(1, max_depth + 1)), default=0.0)


def allocate(alphas: list[float], nodes: int, max_depth: int = MAX_DEPTH,
             rows: list[bool] | None = None) -> list[int]:
    """Spread `nodes` draft tokens over rows greedily by marginal expected acceptance alpha^(d+1); only the
    `rows` marked True (default all) get any."""
    depths = [0] * len(alphas)
    for _ in range(max(0, nodes)):
        gains = [a ** (d + 1) if d < max_depth and (rows is None or rows[i]) else -1.0
                 for i, (a, d) in enumerate(zip(alphas, depths))]
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
    catch_up_seen: float | None = None  # ms per owed token the scheduler's catch-ups took (moving average)
    owed: list[int] = field(default_factory=list)  # this step's rows: tokens each owes the drafter (see depths)
    left: list[int] = field(default_factory=list)  # this step's rows: tokens each has left to generate

    def depths(self, alphas: list[float], node_cap: int | None = None, *, owed: list[int] | None = None,
               left: list[int] | None = None) -> list[int] | None:
        """Per-row chain depths for this step, or None to use `spec` unchanged (the registered policy's).
        Rows that draft nothing learn nothing about their acceptance, so a policy that has drafted nothing
        for PROBE_EVERY steps gets one step of a single draft token per row: an early estimate that priced
        drafting out is corrected rather than kept for the rest of the run. No probe is taken where even two
        probes whose every token was accepted would leave the estimates drafting nothing at this batch size
        (_probe): they could not change the answer, and would feed the drafter everything the rows owe it. A probe
        after which the policy still drafts nothing doubles the wait for the next one (up to PROBE_MAX), so
        where speculation truly does not pay (a wide batch) the probes cost less and less; drafting again
        resets the wait.

        `node_cap` is how many draft tokens the step may carry (a scheduler's token budget, less the rows' own
        tokens and the prompt chunk that must advance beside them): depths over it are cut back to the tokens
        most likely to be accepted, spread over rows by their acceptance (`allocate`) among the rows the policy
        drafted for, so under a full budget confident rows keep drafting and the others decode plainly.

        `owed` and `left` (keyword, per row, both or neither) are the tokens each row owes the drafter
        (Drafter.owed) and has left to generate: the registered policies read them as `self.owed` / `self.left`
        to price each row's catch-up (`owed_ms`, `worth_drafting`); without them nothing is owed. A probe
        drafts only for the rows whose catch-up that best outcome would repay."""
        n = len(alphas)
        self.owed = [0] * n if owed is None else list(owed)
        self.left = [1] * n if left is None else list(left)
        depths = lookup("batching", self.name)(self, alphas)
        if depths is not None and node_cap is not None and sum(depths) > node_cap:
            depths = allocate(alphas, max(0, node_cap), max(depths), [d > 0 for d in depths])
        if depths is None or max(depths, default=0) > 0:
            self.idle = 0
            self.probe_every = PROBE_EVERY
            return depths
        self.idle += 1
        if self.idle < self.probe_every:
            return depths
        probe = self._probe(alphas)
        if probe is None:
            return depths
        self.idle = 0
        self.probe_every = min(2 * self.probe_every, PROBE_MAX)
        return probe

    @property
    def per_row(self) -> bool:
        """Whether the policy chooses each row's depth (False: every row drafts the recipe's tree)."""
        return self.name != "fixed" and self.table is not None

    def _probe(self, alphas: list[float]) -> list[int] | None:
        """A probe's depths (a token for each row whose catch-up it would repay), or None where probing could not
        change the answer soon: where drafting would not pay at this batch size even after this probe and the
        next were accepted whole (each estimate raised as far as two samples raise it, next_alpha). Such a probe
        only feeds the drafter what the rows owe (on the Xeon at c = 4, a second of catch-up per probe for four
        drafted tokens); two, not one, so that a row whose estimate one bad step pulled down can still climb
        back where drafting pays by far (a single row)."""
        if self.table is None:
            return [1] * len(alphas)
        worth, depth = self.uniform_depth([next_alpha(next_alpha(a, ALPHA_MAX), ALPHA_MAX) for a in alphas])
        return [int(w) for w in worth] if depth else None

    def uniform_depth(self, alphas: list[float]) -> tuple[list[bool], int]:
        """The rows worth drafting for (worth_drafting) and the one depth best for them (best_uniform_depth at
        their mean acceptance and summed catch-up); depth 0 when no row is worth it."""
        n = len(alphas)
        worth = self.worth_drafting(alphas)
        m = sum(worth)
        if m == 0:
            return worth, 0
        alpha = sum(a for a, w in zip(alphas, worth) if w) / m
        owed = sum(o for o, w in zip(self.owed_ms(n), worth) if w)
        return worth, best_uniform_depth(self.table, n, alpha, overhead_ms=self.overhead_ms.get(n), owed_ms=owed,
                                         drafting=m, ragged=self.ragged)

    def catch_up_price(self) -> float:
        """ms per token a row owes the drafter: what the scheduler's catch-ups took (observe_catch_up), or
        before any the table's price (CostTable.catch_up_ms)."""
        if self.catch_up_seen is not None:
            return self.catch_up_seen
        return 0.0 if self.table is None else self.table.catch_up_ms()

    def owed_ms(self, rows: int) -> list[float]:
        """This step's rows' catch-up spread over the tokens each has left: owed x catch_up_price / left, ms
        per token it generates (0 for a row that owes nothing). Times the tokens a step gives a row, it is
        what that step pays for the row's catch-up, since once caught up the row drafts for the rest of its
        life."""
        if len(self.owed) != rows:  # the registered policy was called outside depths: nothing is known owed
            return [0.0] * rows
        price = self.catch_up_price()
        return [price * o / max(r, 1) if o > 0 else 0.0 for o, r in zip(self.owed, self.left)]

    def worth_drafting(self, alphas: list[float]) -> list[bool]:
        """Which rows drafting could pay for this step: those for which drafting at their own acceptance and
        best depth saves more per token (drafting_saves, at this batch size and with the overhead learned for
        it) than their catch-up per token left costs (owed_ms; nothing for a row that owes nothing). A row that
        fails gets depth 0 and keeps owing: it is spared the catch-up that no speculation it has left would earn
        back, and a row whose draft is unlikely to be accepted (a low estimate, a weak draft class) does not
        pull the depth of the others down. The test prices each row as if all drafted, and a padded target's
        step as wide as the deepest row's: a simple bound, not a joint optimum."""
        rows = len(alphas)
        if self.table is None:
            return [True] * rows
        owed = self.owed_ms(rows)
        over = self.overhead_ms.get(rows)
        return [o < drafting_saves(self.table, rows, a, overhead_ms=over) for a, o in zip(alphas, owed)]

    def observe_catch_up(self, tokens: int, ms: float) -> None:
        """Learn what the drafter's catch-up costs per owed token from one the scheduler timed (`tokens` owed
        tokens fed in `ms`): a moving average that replaces the table's price, which was measured on a short
        run of tokens from an empty row and not on this deployment's prompts, prefix cache and context."""
        if self.table is None or self.name == "fixed" or tokens <= 0:
            return
        seen = ms / tokens
        self.catch_up_seen = seen if self.catch_up_seen is None else 0.8 * self.catch_up_seen + 0.2 * seen

    def observe(self, depths: list[int], step_ms: float) -> None:
        """Learn what a step of this batch size and depth (the deepest draft; the mean one on a ragged
        target) costs beyond the table's price, from one whose rows drafted `depths` and took `step_ms`
        (admission and prefill excluded); a moving average per depth.

        The drafter's catch-up is not in `step_ms`: the scheduler runs it before the step and reports it to
        `observe_catch_up` instead. It is a one-off per row, priced explicitly and spread over the row's
        remaining tokens (owed_ms); learned here it would be charged again to every later step of the depth
        it happened to fall in, and it would swing with which rows joined, not with the depth."""
        if self.table is None or self.name == "fixed":
            return
        rows, deepest = len(depths), max(depths)
        depth = round(sum(depths) / rows) if self.ragged else deepest
        priced = self.table.step_ms(depths, self.ragged) + deepest * self.table.draft_ms(rows)
        seen = max(0.0, step_ms - priced)
        known = self.overhead_ms.setdefault(rows, {})
        known[depth] = seen if depth not in known else 0.8 * known[depth] + 0.2 * seen


def _batching(name: str) -> Callable[[Policy, list[float]], list[int] | None]:
    """The built-in policies. Each drafts only for the rows worth it (Policy.worth_drafting: drafting pays at
    their acceptance, catch-up included), at a uniform depth priced for those rows' mean acceptance and summed
    catch-up (owed_ms); budget gives them all that depth, allocate and cap spread its nodes (or the recipe's
    budget, or the cap) over them by acceptance."""
    def policy(p: Policy, alphas: list[float]) -> list[int] | None:
        if name == "fixed" or p.table is None:
            return None
        n = len(alphas)
        worth, uniform = p.uniform_depth(alphas)
        m = sum(worth)
        if m == 0:
            return [0] * n
        if name == "budget":
            return [uniform if w else 0 for w in worth]
        if name == "allocate":
            return allocate(alphas, p.node_budget or m * uniform, rows=worth)
        cap = p.token_cap or bend(p.table, n)
        return allocate(alphas, min(cap - n, m * max(uniform, 1)), rows=worth)
    return policy


register("batching", "fixed", _batching("fixed"), "the recipe's tree for every row", builtin=True)
for _name, _doc in (("budget", "one chain depth for all rows from the measured cost at this batch size"),
                    ("allocate", "a per-step node budget spread over rows by expected acceptance"),
                    ("cap", "allocate under a cap on verified tokens at the bend of the cost curve")):
    register("batching", _name, _batching(_name), _doc, builtin=True, presets=(Preset(f"batch-{_name}"),))
