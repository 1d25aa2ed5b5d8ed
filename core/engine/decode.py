"""Autoregressive and speculative generation: draft a tree, verify it in one target forward, commit.

Autoregressive decoding is the same loop with a root-only tree, so both paths share every line that
touches the cache. Verification rules:
  greedy     accept the longest path whose tokens equal the target's argmax, plus the bonus token;
  seeded     the same with the target's choice = argmax(logits/T + gumbel(seed, request, position));
  rejection  standard speculative sampling on a chain (accept with min(1, p/q), else resample p - q).
Each rule is an `AcceptanceRule` registered under kind "acceptance" (core/engine/builtins.py); generation
looks the recipe's rule up in the registry, so a plugin rule runs through exactly this loop. A draft-length
policy (kind "draft_length") may shorten each step's draft from the row's recent acceptance.
Tie policy: the target's choice is torch.argmax over its logits in the run's dtype (the first index wins
an exact tie); near-ties that flip between kernels of different shapes are counted apart by forcing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specpilot.core.engine.drafters import Drafter, DraftMode, TreeSpec
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.sampling import filtered, seeded_scores
from specpilot.core.engine.tree import DraftTree, batch_tensors
from specpilot.core.mechanisms import lookup


class GenerationError(ValueError):
    """A request that cannot be served as asked; the message says what to change."""


def misfit(prompt_tokens: int, new_tokens: int, context: int, new_name: str = "max_new_tokens") -> str | None:
    """Why a request of `prompt_tokens` asking for `new_tokens` more does not fit a context of `context` tokens,
    in the one wording every layer uses (decoding, the scheduler, the judge's request sets, the HTTP 400, which
    calls the limit `new_name`); None when it fits."""
    if prompt_tokens < 1:
        return "the prompt is empty; give at least one token"
    if new_tokens < 1:
        return f"{new_name} is {new_tokens}; ask for at least 1 new token"
    if prompt_tokens + new_tokens > context:
        room = max(context - prompt_tokens, 0)
        return (f"the context is {context} tokens: the prompt has {prompt_tokens} and {new_name} asks for {new_tokens} "
                f"more, but {room} fit; shorten the prompt or lower {new_name}")
    return None


@dataclass
class StepStats:
    draft_ms: float
    verify_ms: float
    commit_ms: float
    host_ms: float
    nodes: int
    accepted: list[int]
    prefill_ms: float = 0.0  # prompt chunks prefilled in the same scheduler step (not in host_ms)
    prefilled: int = 0  # their tokens


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    steps: list[StepStats]
    seconds: float
    committed: list[list[int]] = field(default_factory=list)
    cache: object | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def summary(self) -> dict:
        accepted = [a for s in self.steps for a in s.accepted]
        phases = {k: sum(getattr(s, k) for s in self.steps) for k in ("draft_ms", "verify_ms", "commit_ms", "host_ms",
                                                                            "prefill_ms")}
        return {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds > 0 else 0.0,
            "steps": len(self.steps),
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else 0.0,
            "nodes_verified": sum(s.nodes for s in self.steps),
            **phases,
        }


@dataclass(frozen=True)
class Verification:
    sampling: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, verify: Any = None, speculative: bool = True) -> "Verification":
        """The one reading of a recipe's [verify] section (None: greedy). Speculating, the recipe's own rule.
        Otherwise the token-exact rule its speculation is measured against, which plain decoding, the forcing
        reference, acceptance replay and a server's default for sampled requests use: a sampling recipe samples
        seeded at its temperature, top_p and seed (rejection sampling is exact in distribution only, and seeded
        sampling is its token-exact counterpart), a greedy one is greedy."""
        if verify is None or verify.sampling == "greedy":
            return cls()
        return cls(verify.sampling if speculative else "seeded", verify.temperature, verify.top_p, verify.seed)


Choices = Callable[[torch.Tensor, list[DraftTree], "Verification", torch.Tensor, list[int]], list]
Accept = Callable[[DraftTree, object, torch.Generator], tuple[list[int], int]]
DraftLength = Callable[[int, list[int]], int]


@dataclass(frozen=True)
class AcceptanceRule:
    """How verification decides: `choices` turns the target's logits [B, T, V] over every row's tree into
    a per-row choice (ids, probabilities, ...); `accept` walks one row's tree with its choice and returns
    the accepted node path and the bonus token. `batched`: continuous batching may serve it."""

    choices: Choices
    accept: Accept
    batched: bool = False


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work, so a host timer measures it (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accept_path(tree: DraftTree, choice: list[int], gen: torch.Generator | None = None) -> tuple[list[int], int]:
    """Greedy walk: follow children whose token equals the target's choice; return path and bonus."""
    children = {(tree.parents[i], tree.tokens[i]): i for i in range(1, len(tree))}
    path, node = [], 0
    while (node, choice[node]) in children:
        node = children[(node, choice[node])]
        path.append(node)
    return path, choice[node]


def _accept_rejection(tree: DraftTree, p: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Speculative sampling on a chain: p [T, V] target probabilities at each node."""
    path, node = [], 0
    for child in range(1, len(tree)):
        q = tree.q[child]
        x = tree.tokens[child]
        if torch.rand((), generator=gen).item() * q[x].item() < p[node, x].item():
            path.append(child)
            node = child
            continue
        residual = (p[node] - q).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[node]
        return path, int(torch.multinomial(dist, 1, generator=gen).item())
    return path, int(torch.multinomial(p[node], 1, generator=gen).item())


def cache_room(nodes: int) -> int:
    """Target cache positions needed past the longest request when steps verify trees of up to `nodes`
    nodes: a step's tree is written after the committed prefix before it is compacted, plus root and bonus."""
    return 2 * nodes + 4


def drafter_room(nodes: int) -> int:
    """Drafter cache positions needed past the target's: one drafted tree ahead, plus root and bonus."""
    return nodes + 2


@dataclass
class Step:
    """One draft -> verify -> accept -> commit step over the rows in `rows` (indices into `trees`), with
    the perf_counter at its start and end and its phase times."""

    trees: list[DraftTree]
    rows: list[int]
    paths: list[list[int]]
    emitted: list[list[int]]  # per row in `rows`: the accepted draft tokens, then the bonus token
    start: float
    end: float
    draft_ms: float
    verify_ms: float
    commit_ms: float

    @property
    def accepted(self) -> list[int]:
        """Tokens each row gained (accepted draft tokens + the bonus)."""
        return [len(e) for e in self.emitted]

    @property
    def nodes(self) -> int:
        """Tree nodes verified for the rows that took part."""
        return sum(len(self.trees[b]) for b in self.rows)

    def stats(self, host_ms: float) -> StepStats:
        return StepStats(self.draft_ms, self.verify_ms, self.commit_ms, host_ms, self.nodes, self.accepted)


def step(target: Transformer, cache, draft: Callable[[], list[DraftTree]], drafter: Drafter | None,
         rows: list[int], ver: Verification, rule: AcceptanceRule, req: torch.Tensor, lengths: list[int],
         gen: torch.Generator | None) -> Step:
    """The step both generation paths run (one request or a continuous batch): `draft()` gives every cache
    row's tree, one target forward verifies them all, the rule accepts a path for each row in `rows`, and
    the cache (and drafter, when there is one) keeps only those paths; `lengths` advances to match."""
    dev = target.device
    t0 = time.perf_counter()
    trees = draft()
    sync(dev)
    t1 = time.perf_counter()
    choice = verify(target, cache, trees, ver, req, lengths, rule)
    sync(dev)
    t2 = time.perf_counter()
    paths, emitted = [], []
    for b in rows:
        path, bonus = rule.accept(trees[b], choice[b], gen)
        paths.append(path)
        emitted.append([trees[b].tokens[i] for i in path] + [bonus])
    commit_paths(cache, rows, paths, lengths)
    if drafter is not None:
        drafter.commit(rows, paths, emitted)
    sync(dev)
    t3 = time.perf_counter()
    return Step(trees, rows, paths, emitted, t0, t3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)


def generate(target: Transformer, drafter: Drafter | None, prompts: list[list[int]],
             max_new_tokens: int | list[int], spec: TreeSpec | None = None,
             verification: Verification | None = None, request_ids: list[int] | None = None,
             eos_token_ids: list[int] | None = None, draft_length: DraftLength | None = None) -> GenerateResult:
    """Generate for a batch of prompts; `drafter=None` (or spec=None) is autoregressive decoding.
    `draft_length(depth, recent)` caps each row's draft depth per step from its recent accepted counts."""
    ver = verification or Verification()
    rule: AcceptanceRule = lookup("acceptance", ver.sampling)
    B = len(prompts)
    if B == 0:
        return GenerateResult([], [], 0.0)
    limits = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    ctx = target.cfg.max_position_embeddings
    for i, (p, n) in enumerate(zip(prompts, limits)):
        if why := misfit(len(p), n, ctx):
            raise GenerationError(f"request {i}: {why}")
    speculative = drafter is not None and spec is not None
    extra = cache_room(spec.max_nodes) if speculative else 2
    max_len = max(len(p) + n for p, n in zip(prompts, limits)) + extra
    dev = target.device
    eos = set(target.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    req = torch.tensor(request_ids if request_ids is not None else list(range(B)))
    gen = torch.Generator().manual_seed(ver.seed)
    mode = DraftMode(ver.sampling, ver.temperature, ver.top_p, ver.seed, req, gen)

    with torch.inference_mode():
        start = time.perf_counter()
        cache = target.new_cache(B, max_len)
        pre = [p[:-1] for p in prompts]
        Pm = max(len(p) for p in pre)
        if Pm > 0:
            toks = torch.tensor([p + [0] * (Pm - len(p)) for p in pre], device=dev)
            causal = torch.tril(torch.ones(Pm, Pm, dtype=torch.bool, device=dev)).expand(B, Pm, Pm)
            target.step(toks, cache, cache.lengths, torch.arange(Pm, device=dev).expand(B, Pm), causal,
                        logits_at=torch.zeros(B, 0, dtype=torch.long, device=dev))
            cache.lengths.copy_(torch.tensor([len(p) for p in pre], device=dev))
        if speculative:
            drafter.reset(prompts, max_len + drafter_room(spec.max_nodes))
        lengths = [len(p) for p in pre]
        roots = [p[-1] for p in prompts]
        out: list[list[int]] = [[] for _ in range(B)]
        committed = [list(p[:-1]) for p in prompts]
        active = [n > 0 for n in limits]
        steps: list[StepStats] = []
        recent: list[list[int]] = [[] for _ in range(B)]

        def draft() -> list[DraftTree]:
            if speculative and draft_length is not None:
                caps = [draft_depth(draft_length, spec.depth_limit, recent[b]) for b in range(B)]
                step_spec = spec.shortened(max(c for c, a in zip(caps, active) if a))
                return [truncate_tree(t, c) for t, c in zip(drafter.draft(step_spec, mode, active), caps)]
            if speculative:
                return drafter.draft(spec, mode, active)
            return [DraftTree.root(r) for r in roots]

        t_prev = time.perf_counter()
        while any(active):
            taken = step(target, cache, draft, drafter if speculative else None, [b for b in range(B) if active[b]],
                         ver, rule, req, lengths, gen)
            for b, toks in zip(taken.rows, taken.emitted):
                recent[b] = remember(recent[b], len(toks))
                committed[b].append(roots[b])
                committed[b].extend(toks[:-1])
                roots[b] = toks[-1]
                _, finish = emit(toks, out[b], limits[b], eos)
                active[b] = finish is None
            t4 = time.perf_counter()
            steps.append(taken.stats((t4 - taken.end + taken.start - t_prev) * 1e3))
            t_prev = t4
        seconds = time.perf_counter() - start
    return GenerateResult(out, steps, seconds, committed, cache)


RECENT_STEPS = 16  # how many of a row's last steps a draft-length policy sees


def remember(recent: list[int], gained: int) -> list[int]:
    """A row's recent window of tokens gained per step, with this step's `gained` added."""
    return (recent + [gained])[-RECENT_STEPS:]


def emit(tokens: list[int], out: list[int], limit: int, eos: set[int]) -> tuple[list[int], str | None]:
    """Append one step's tokens to a request's output up to where it ends: at an EOS (kept; "stop") or at its
    `limit` of new tokens ("length"). Returns the tokens appended and why it ended (None: it goes on). Both
    generation paths end requests by this one rule."""
    new = []
    for t in tokens:
        new.append(t)
        out.append(t)
        if t in eos:
            return new, "stop"
        if len(out) >= limit:
            return new, "length"
    return new, None


def draft_depth(draft_length: DraftLength, depth: int, recent: list[int]) -> int:
    """The policy's depth for one row, clamped to [1, depth]: a policy shortens drafts, never lengthens them."""
    return max(1, min(depth, int(draft_length(depth, list(recent)))))


def truncate_tree(tree: DraftTree, depth: int) -> DraftTree:
    """Keep only the nodes of a drafted tree within `depth` (parents precede children, so a prefix)."""
    if max(tree.depths) <= depth:
        return tree
    keep = [i for i in range(len(tree)) if tree.depths[i] <= depth]
    new = {old: j for j, old in enumerate(keep)}
    return DraftTree([tree.tokens[i] for i in keep], [new.get(tree.parents[i], -1) for i in keep],
                     [tree.depths[i] for i in keep], [tree.q[i] for i in keep])


def verify(target: Transformer, cache, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
           lengths: list[int], rule: AcceptanceRule | None = None) -> list:
    """One target forward over every row's tree; the target's choice at every node (by the recipe's rule)."""
    tokens, depths, anc = batch_tensors(trees, target.device)
    B, T = tokens.shape
    logits = target.step(tokens, cache, cache.lengths, depths, None if B == 1 and T == 1 else anc,
                         sizes=[len(t) for t in trees])
    return (rule or lookup("acceptance", ver.sampling)).choices(logits, trees, ver, req, lengths)


def commit_paths(cache, rows: list[int], paths: list[list[int]], lengths: list[int]) -> None:
    """Keep each row's root and accepted path in the cache (in place) and advance `lengths` to match."""
    cache.compact(rows, [[lengths[b] + i for i in path] for b, path in zip(rows, paths)],
                  [lengths[b] + 1 for b in rows])
    for b, path in zip(rows, paths):
        lengths[b] += len(path) + 1
    cache.lengths.copy_(torch.tensor(lengths, device=cache.lengths.device))


def greedy_choices(logits: torch.Tensor, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
                   lengths: list[int]) -> list:
    """The target's argmax at every node."""
    return logits.argmax(-1).tolist()


def rejection_choices(logits: torch.Tensor, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
                      lengths: list[int]) -> list:
    """The target's filtered probabilities at every node, per row."""
    return [filtered(logits[b], ver.temperature, ver.top_p).softmax(-1) for b in range(len(trees))]


def seeded_choices(logits: torch.Tensor, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
                   lengths: list[int]) -> list:
    """argmax(logits/T + gumbel(seed, request, position)) at every node."""
    B, T, V = logits.shape
    depth = torch.tensor([t.depths + [0] * (T - len(t)) for t in trees])
    positions = torch.tensor(lengths)[:, None] + depth + 1
    scores = seeded_scores(logits.reshape(B * T, V), ver.temperature, ver.top_p, ver.seed,
                           req[:, None].expand(B, T).reshape(-1), positions.reshape(-1))
    return scores.argmax(-1).view(B, T).tolist()
