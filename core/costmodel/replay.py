"""Acceptance replay: the accepted length of any tree on the drafter's real guesses, without the target.

Recording: the target decodes each request autoregressively (greedy, or seeded like the engine) `extra`
tokens past its end with EOS ignored, because a speculative step may accept tokens beyond the limit or an
EOS and the engine counts them in its accepted length. One teacher-forced drafter pass over
prompt + continuation then gives, at every position j, the rank (0 = the drafter's top choice, ranked by
the same scores the drafter drafts with) and probability of the token the target chose.

Simulation walks each request as the engine does: from the root at position i accept depth d while the
ranks r[i+1..i+d] form a path of the tree, emit d + 1 tokens (the bonus), continue at i + d + 1, and stop
once the request's output is complete. Along an accepted path the drafter saw exactly the true context,
so for static trees (chains included) the result equals a real greedy run in float32. Dynamic trees
depend on the drafter's scores off the true path, which the ranks do not keep, and the n-gram drafter on
the context: both are replayed by running the engine's own drafter at each step on the true context and
walking its tree along the target's tokens (drafter calls only, never the target), which is exact too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specpilot.core.costmodel import trees
from specpilot.core.engine import Engine
from specpilot.core.engine.decode import Verification, cache_room
from specpilot.core.engine.drafters import Drafter, DraftMode, ModelDrafter, NgramDrafter, TreeSpec
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.sampling import seeded_scores
from specpilot.core.engine.scheduler import generate
from specpilot.core.engine.tree import chain_paths, static_prefixes
from specpilot.core.recipe import Recipe

DEFAULT_MAX_DEPTH = 8
DEFAULT_EXTRA = 16


@dataclass
class Trace:
    """One request: prompt + the target's continuation, and the drafter's rank of every emitted token."""

    tokens: list[int]
    prompt_len: int
    n_out: int
    request_id: int = 0
    ranks: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


@dataclass
class Simulation:
    """Per-request accepted lengths (bonus counted) and verified node counts (root counted) per step."""

    accepted: list[list[int]]
    nodes: list[list[int]]
    tokens: int
    draft_ms: float = 0.0

    @property
    def steps(self) -> int:
        return sum(len(a) for a in self.accepted)

    @property
    def mean_accepted(self) -> float:
        steps = self.steps
        return sum(sum(a) for a in self.accepted) / steps if steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per step; below mean_accepted because the last step may run past the end."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def mean_nodes(self) -> float:
        steps = self.steps
        return sum(sum(n) for n in self.nodes) / steps if steps else 0.0


@dataclass
class Replay:
    """Traces of one drafter: `method` is "model", "early_exit" or "ngram"."""

    method: str
    traces: list[Trace]
    ngram_max: int = 3
    model: Transformer | None = field(default=None, repr=False)
    verification: Verification = field(default_factory=Verification)
    _sims: dict = field(default_factory=dict, repr=False)
    _frontier: dict = field(default_factory=dict, repr=False)

    def histogram(self) -> list[float]:
        """Frequency of each rank over the emitted positions (what the tree builders optimise)."""
        counts: dict[int, int] = {}
        total = 0
        for t in self.traces:
            for j in range(t.prompt_len, t.prompt_len + t.n_out):
                counts[t.ranks[j]] = counts.get(t.ranks[j], 0) + 1
                total += 1
        size = max(counts, default=-1) + 1
        return [counts.get(r, 0) / total for r in range(size)] if total else []


def record(target: Transformer, prompts: list[list[int]], limits: list[int], extra: int = DEFAULT_EXTRA,
           verification: Verification | None = None, request_ids: list[int] | None = None,
           eos_token_ids: list[int] | None = None) -> list[Trace]:
    """The target's own continuations, one request at a time, `extra` tokens past each request's end."""
    ver = verification or Verification()
    if ver.sampling not in ("greedy", "seeded"):
        ver = Verification()
    eos = set(target.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    ids = request_ids if request_ids is not None else list(range(len(prompts)))
    ctx = target.cfg.max_position_embeddings
    out = []
    for prompt, limit, rid in zip(prompts, limits, ids):
        n = max(limit, min(limit + extra, ctx - len(prompt)))
        cont = generate(target, None, [prompt], n, None, ver, [rid], eos_token_ids=[]).tokens[0]
        end = next((i + 1 for i, t in enumerate(cont[:limit]) if t in eos), min(limit, len(cont)))
        out.append(Trace(list(prompt) + cont, len(prompt), end, rid))
    return out


def teacher_force(drafter: Transformer, traces: list[Trace], method: str = "model",
                  verification: Verification | None = None) -> Replay:
    """One drafter forward per request; ranks by the scores the drafter drafts with (greedy or seeded)."""
    ver = verification or Verification()
    dev = drafter.device
    with torch.inference_mode():
        for t in traces:
            n = len(t.tokens)
            cache = drafter.new_cache(1, n + 1)
            causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))[None]
            rows = torch.arange(t.prompt_len - 1, n - 1, device=dev)
            logits = drafter.step(torch.tensor([t.tokens], device=dev), cache, cache.lengths,
                                  torch.arange(n, device=dev)[None], causal, logits_at=rows[None])[0]
            if ver.sampling == "seeded":
                req = torch.full((len(rows),), t.request_id)
                scores = seeded_scores(logits, ver.temperature, ver.top_p, ver.seed, req, rows.cpu() + 1)
            else:
                scores = logits.float()
            scores = scores.log_softmax(-1)
            true = torch.tensor(t.tokens[t.prompt_len:], device=scores.device)[:, None]
            s = scores.gather(1, true)
            vocab = torch.arange(scores.shape[1], device=scores.device)[None]
            ranks = (scores > s).sum(1) + ((scores == s) & (vocab < true)).sum(1)
            t.ranks = [-1] * t.prompt_len + ranks.tolist()
            t.probs = [0.0] * t.prompt_len + s[:, 0].exp().tolist()
    return Replay(method, traces, model=drafter, verification=ver)


def ngram_replay(traces: list[Trace], ngram_max: int = 3) -> Replay:
    """The n-gram drafter needs no pass: its lookups are re-run on the same sequences when simulating."""
    return Replay("ngram", traces, ngram_max)


def _trie(nodes: list[tuple[int, ...]]) -> dict:
    root: dict = {}
    for node in sorted(nodes, key=len):
        cur = root
        for r in node:
            cur = cur.setdefault(r, {})
    return root


def _run_ranks(replay: Replay, nodes: list[tuple[int, ...]]) -> Simulation:
    trie = _trie(nodes)
    size = len(set(nodes)) + 1
    accepted, counts = [], []
    for t in replay.traces:
        i, emitted, steps = t.prompt_len - 1, 0, []
        last = len(t.tokens) - 1
        while emitted < t.n_out and i < last:
            node, d = trie, 0
            while i + d + 1 < last and t.ranks[i + d + 1] in node:
                node = node[t.ranks[i + d + 1]]
                d += 1
            steps.append(d + 1)
            emitted += d + 1
            i += d + 1
        accepted.append(steps)
        counts.append([size] * len(steps))
    return Simulation(accepted, counts, sum(t.n_out for t in replay.traces))


def _run_drafter(replay: Replay, spec: TreeSpec) -> Simulation:
    """Run the engine's own drafter at every step on the true context and walk its tree along the
    target's tokens: exact for any tree policy, and it costs drafter calls only (never the target)."""
    accepted, counts, draft_s, calls = [], [], 0.0, 0
    ver = replay.verification
    for t in replay.traces:
        if replay.model is None:
            drafter: Drafter = NgramDrafter(replay.ngram_max)
        else:
            drafter = ModelDrafter(replay.model)
        mode = DraftMode(ver.sampling, ver.temperature, ver.top_p, ver.seed, torch.tensor([t.request_id]))
        drafter.reset([t.tokens[: t.prompt_len]], len(t.tokens) + cache_room(spec.max_nodes))
        i, emitted, steps, sizes = t.prompt_len - 1, 0, [], []
        last = len(t.tokens) - 1
        while emitted < t.n_out and i < last:
            t0 = time.perf_counter()
            with torch.inference_mode():
                tree = drafter.draft(spec, mode, [True])[0]
            draft_s += time.perf_counter() - t0
            calls += 1
            children = {(tree.parents[k], tree.tokens[k]): k for k in range(1, len(tree))}
            path, node = [], 0
            while i + len(path) + 1 < last and (node, t.tokens[i + len(path) + 1]) in children:
                node = children[(node, t.tokens[i + len(path) + 1])]
                path.append(node)
            d = len(path)
            with torch.inference_mode():
                drafter.commit([0], [path], [t.tokens[i + 1: i + d + 2]])
            steps.append(d + 1)
            sizes.append(len(tree))
            emitted += d + 1
            i += d + 1
        accepted.append(steps)
        counts.append(sizes)
    return Simulation(accepted, counts, sum(t.n_out for t in replay.traces), 1e3 * draft_s / max(calls, 1))


def run(replay: Replay, spec: TreeSpec | list[list[int]]) -> Simulation:
    """Replay a tree shape: rank paths or a TreeSpec. Static trees walk the recorded ranks; dynamic trees
    and the n-gram drafter run the drafter itself on the true contexts (a replay without its model, e.g.
    one loaded from JSON, approximates a dynamic tree by the best static tree of its budget and depth)."""
    if not isinstance(spec, TreeSpec):
        spec = TreeSpec("static", [list(p) for p in spec])
    if replay.method == "ngram" or (spec.kind == "dynamic" and replay.model is not None):
        key = ("drafter", spec.kind, tuple(map(tuple, spec.paths or [])), spec.depth, spec.topk, spec.budget)
        if key not in replay._sims:
            replay._sims[key] = _run_drafter(replay, spec)
        return replay._sims[key]
    if spec.kind == "dynamic":
        spec = TreeSpec("static", best_tree(replay, spec.budget, spec.depth))
    nodes = static_prefixes(spec.paths or [])
    key = tuple(nodes)
    if key not in replay._sims:
        replay._sims[key] = _run_ranks(replay, nodes)
    return replay._sims[key]


def simulate(replay: Replay, paths: list[list[int]]) -> float:
    """Mean accepted tokens per step (bonus counted) of the static tree given as rank paths."""
    return run(replay, paths).mean_accepted


def _frontier(replay: Replay, budget: int, max_depth: int) -> list[tuple[float, list[list[int]]]]:
    """Best replayed tree with at most n nodes, for n = 1..budget (a running maximum, so monotone)."""
    key = max_depth
    have = replay._frontier.get(key, [])
    if len(have) >= budget:
        return have
    if replay.method == "ngram":
        best: list[tuple[float, list[list[int]]]] = []
        for n in range(1, budget + 1):
            paths = chain_paths(min(n, max_depth))
            score = simulate(replay, paths)
            best.append((score, paths) if not best or score > best[-1][0] else best[-1])
        replay._frontier[key] = best
        return best
    freq = replay.histogram()
    greedy = trees.grow_greedy(freq, budget, max_depth)
    dp = trees.sequoia(freq, budget, max_depth)
    best = []
    for n in range(1, budget + 1):
        top = best[-1] if best else None
        for paths in (chain_paths(min(n, max_depth)), trees.leaves(greedy[:n]), trees.leaves(dp[n])):
            if paths:
                score = simulate(replay, paths)
                if top is None or score > top[0]:
                    top = (score, paths)
        best.append(top)
    replay._frontier[key] = best
    return best


def best_tree(replay: Replay, budget: int, max_depth: int = DEFAULT_MAX_DEPTH) -> list[list[int]]:
    """Rank paths of the best tree with at most `budget` nodes and depth <= max_depth on these guesses.

    Candidates per node count: the chain, greedy growth and the Sequoia DP tree; each is replayed and the
    best so far is kept, so the replayed accepted length never decreases with the budget and is never
    below the chain's.
    """
    if budget < 1:
        raise ValueError(f"budget must be at least 1 node, got {budget}")
    return _frontier(replay, budget, max_depth)[budget - 1][1]


def replay_for(engine: Engine, recipe: Recipe, traces: list[Trace], made: dict | None = None) -> Replay:
    """The replay of the recipe's drafter on the recorded traces (memoised in `made` per drafter)."""
    made = {} if made is None else made
    target, drafter = engine.models_for(recipe)
    d = recipe.draft
    layers = d.exit_layers(target.cfg.num_layers)
    key = d.drafter_key(target.cfg.num_layers) + (f":{d.ngram_max}" if d.method == "ngram" else "")
    if key not in made:
        if d.method == "ngram":
            made[key] = ngram_replay(traces, d.ngram_max)
        else:
            model = target.truncated(layers) if d.method == "early_exit" else drafter
            if model is None:
                raise ValueError("draft.method = 'model' needs a drafter checkpoint to replay")
            made[key] = teacher_force(model, _copy(traces), d.method, choice_rule(recipe))
    return made[key]


def choice_rule(recipe: Recipe) -> Verification:
    """How the target chose for this recipe: seeded recipes seeded, everything else greedy."""
    return Verification.of(recipe.verify, speculative=False)


def _copy(traces: list[Trace]) -> list[Trace]:
    return [Trace(list(t.tokens), t.prompt_len, t.n_out, t.request_id) for t in traces]
