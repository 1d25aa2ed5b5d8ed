"""Batching policies: how deep each row of a batched step drafts, priced from measured step costs.

Batching policies (kind "batching" in core/mechanisms.py, registered at the end of this module, looked up by
name) decide each row's draft depth per step:
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


@dataclass
class CostTable:
    """Measured ms of a target forward of `rows x tokens` and of a drafter forward of `rows x 1`."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    source: str = ""  # where the prices came from, said to the user: measured now, or the file they were read from

    def to_dict(self) -> dict:
        """The prices as JSON-able lists (core/engine/cost_store.py keeps them per deployment)."""
        return {"verify": [[r, t, ms] for (r, t), ms in sorted(self.verify.items())],
                "draft": [[r, ms] for r, ms in sorted(self.draft.items())]}

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "CostTable":
        """The table `to_dict` wrote; ValueError on anything else."""
        try:
            verify = {(int(r), int(t)): float(ms) for r, t, ms in data["verify"]}
            draft = {int(r): float(ms) for r, ms in data["draft"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a cost table ({type(exc).__name__}: {exc})") from None
        if not verify or any(ms <= 0 for ms in [*verify.values(), *draft.values()]):
            raise ValueError("not a cost table (no prices, or a price that is not positive)")
        return cls(verify, draft, source)

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

    def depths(self, alphas: list[float], node_cap: int | None = None) -> list[int] | None:
        """Per-row chain depths for this step, or None to use `spec` unchanged (the registered policy's).
        Rows that draft nothing learn nothing about their acceptance, so a policy that has drafted nothing
        for PROBE_EVERY steps gets one step of a single draft token per row: an early estimate that priced
        drafting out is corrected rather than kept for the rest of the run. No probe is taken where even the
        best acceptance an estimate can reach (ALPHA_MAX) would draft nothing at this batch size: a probe then
        could not change the answer, and it would feed the drafter every prompt it has been spared. A probe
        after which the policy still drafts nothing doubles the wait for the next one (up to PROBE_MAX), so
        where speculation truly does not pay (a wide batch) the probes cost less and less; drafting again
        resets the wait.

        `node_cap` is how many draft tokens the step may carry (a scheduler's token budget, less the rows' own
        tokens and the prompt chunk that must advance beside them): depths over it are cut back to the tokens
        most likely to be accepted, spread over rows by their acceptance (`allocate`), so under a full budget
        confident rows keep drafting and the others decode plainly."""
        depths = lookup("batching", self.name)(self, alphas)
        if depths is not None and node_cap is not None and sum(depths) > node_cap:
            depths = allocate(alphas, max(0, node_cap), max(depths))
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

    @property
    def per_row(self) -> bool:
        """Whether the policy chooses each row's depth (False: every row drafts the recipe's tree)."""
        return self.name != "fixed" and self.table is not None

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


def _batching(name: str) -> Callable[[Policy, list[float]], list[int] | None]:
    def policy(p: Policy, alphas: list[float]) -> list[int] | None:
        if name == "fixed" or p.table is None:
            return None
        n = len(alphas)
        uniform = best_uniform_depth(p.table, n, sum(alphas) / n, overhead_ms=p.overhead_ms.get(n))
        if name == "budget":
            return [uniform] * n
        if name == "allocate":
            return allocate(alphas, p.node_budget or n * uniform)
        cap = p.token_cap or bend(p.table, n)
        return allocate(alphas, min(cap - n, n * max(uniform, 1)))
    return policy


register("batching", "fixed", _batching("fixed"), "the recipe's tree for every row", builtin=True)
for _name, _doc in (("budget", "one chain depth for all rows from the measured cost at this batch size"),
                    ("allocate", "a per-step node budget spread over rows by expected acceptance"),
                    ("cap", "allocate under a cap on verified tokens at the bend of the cost curve")):
    register("batching", _name, _batching(_name), _doc, builtin=True, presets=(Preset(f"batch-{_name}"),))
