"""Which agents a round runs, and what each is asked to work on.

`--agents local:4,claude:2` names how many of each kind; local agents are picked per round to match the
cost model's largest gaps (the memory agent first when something remembered applies), and agent i gets
direction i, so the biggest gap always gets the first agent.
"""

from __future__ import annotations

import re
from typing import Any

from specpilot.core.agents.base import Agent
from specpilot.core.agents.local import DEFAULT_ORDER, GAP_AGENTS, LocalAgent, MemoryAgent
from specpilot.core.memory import applicable
from specpilot.core.recipe import Recipe

KINDS = ("local", "claude")
SPEC_HINT = "agents must look like local:4,claude:2"
_ITEM = re.compile(r"^\s*([a-z]+)\s*:\s*(\d+)\s*$")

HINTS = {
    "acceptance": "lock in more tokens per verify step: tree shape (static from replay, or dynamic), draft depth",
    "drafting": "cut draft time per step: a cheaper drafter (n-gram, early exit and its layer), shorter drafts",
    "weights": "read fewer bytes per weight, exactly: the checkpoint's own GGUF blocks (weights.format = 'gguf', "
               "drafter = true)",
    "verify": "bring the verify step toward its bandwidth floor: a faster linear backend (runtime.linear), fewer "
              "weight bytes (packed12), fewer nodes",
    "host": "cut per-step host overhead: fewer steps per token, less Python per step",
    "prompt": "the prompt's prefill, outside the decode steps: compute-bound products that exact float32 keeps "
              "at the GEMM's peak; it shrinks per token with longer outputs, and no recipe field moves it",
    "dispatch": "cut the verify forward's time outside its weight products (op dispatch, norms, attention): fewer "
                "forwards per token (longer drafts, bigger trees), a fused forward (runtime.linear = 'fused')",
    "batching": "share the verify budget across requests: batching policy and node budget",
}


def parse_agents(spec: str) -> list[tuple[str, int]]:
    """'local:4,claude:2' -> [('local', 4), ('claude', 2)]; anything else is a ValueError saying the shape."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{SPEC_HINT}; got an empty value")
    out: list[tuple[str, int]] = []
    for item in spec.split(","):
        match = _ITEM.match(item)
        if not match:
            raise ValueError(f"{SPEC_HINT}; {item.strip()!r} is not KIND:COUNT")
        kind, count = match.group(1), int(match.group(2))
        if kind not in KINDS:
            raise ValueError(f"{SPEC_HINT}; unknown agent kind {kind!r} (known: {', '.join(KINDS)})")
        if count < 1:
            raise ValueError(f"{SPEC_HINT}; {kind} needs a count of at least 1, got {count}")
        if any(k == kind for k, _ in out):
            raise ValueError(f"{SPEC_HINT}; {kind!r} is given twice")
        out.append((kind, count))
    return out


def ranked_gaps(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Gap components, largest first (the report's largest_gap leads on a tie)."""
    gaps = [g for g in (report or {}).get("gaps", []) if isinstance(g, dict) and "component" in g]
    largest = (report or {}).get("largest_gap")
    return sorted(gaps, key=lambda g: (-float(g.get("ms_per_token", 0.0)), g["component"] != largest))


def directions(report: dict[str, Any] | None, n: int) -> list[str]:
    """One direction per agent: agent i works on the i-th largest gap (cycling when agents outnumber gaps)."""
    gaps = ranked_gaps(report)
    if not gaps:
        return ["no gap breakdown this round: find any lossless speedup over the incumbent"] * n
    total = sum(max(0.0, float(g.get("ms_per_token", 0.0))) for g in gaps) or 1.0
    out = []
    for i in range(n):
        g = gaps[i % len(gaps)]
        ms = float(g.get("ms_per_token", 0.0))
        rank = "the largest" if i % len(gaps) == 0 else f"#{i % len(gaps) + 1}"
        hint = HINTS.get(g["component"], "reduce it")
        out.append(f"{g['component']} gap ({rank}): {ms:.2f} ms/token, {ms / total:.0%} of the gap to the ceiling; "
                   f"{hint}")
    return out


def _pick(report: dict[str, Any] | None, n: int, with_memory: bool, only: tuple[str, ...] | None = None,
          skip: tuple[str, ...] = ()) -> list[type[LocalAgent]]:
    """`only`: the local agents a run may use (by name; None = all); `skip`: ones already tried this round."""
    chosen: list[type[LocalAgent]] = [MemoryAgent] if with_memory else []
    tiers = [sorted(GAP_AGENTS.get(g["component"], ()), key=lambda c: c.applies(report) is not None)  # applying first
             for g in ranked_gaps(report)]
    for tier in range(max((len(t) for t in tiers), default=0)):
        for classes in tiers:
            if tier < len(classes) and classes[tier] not in chosen:
                chosen.append(classes[tier])
    chosen += [c for c in DEFAULT_ORDER if c not in chosen]
    chosen = [c for c in chosen if (only is None or c.default_name in only) and c.default_name not in skip]
    useful = [c for c in chosen if c.applies(report) is None]
    return (useful + [c for c in chosen if c not in useful])[:n]


def local_agents_for(report: dict[str, Any] | None, n: int, memory: list[dict[str, Any]] | None,
                     incumbent: Recipe | None = None, seed: int = 0, only: tuple[str, ...] | None = None,
                     skip: tuple[str, ...] = ()) -> list[Agent]:
    """The n local agents best matched to this round's largest gaps (at most one of each kind), memory first
    when a remembered fragment applies to the incumbent (to any recipe when `incumbent` is None)."""
    with_memory = bool(applicable(memory or [], incumbent))
    picked = _pick(report, n, with_memory, only, skip)
    if skip:  # a second pass only runs agents whose mechanism applies here
        picked = [c for c in picked if c.applies(report) is None]
    return [cls(seed=seed) for cls in picked]


def uncovered(report: dict[str, Any] | None, counts: dict[str, int], only: tuple[str, ...] | None = None) -> list[str]:
    """Gap components that lose time and that no agent of the run can act on (Claude agents can act on any;
    a local agent acts on the gaps GAP_AGENTS lists it for, where its mechanism applies)."""
    if counts.get("claude"):
        return []
    out = []
    for g in ranked_gaps(report):
        if float(g.get("ms_per_token", 0.0)) <= 0.0:
            continue  # nothing lost there: no agent is needed
        able = [c for c in GAP_AGENTS.get(g["component"], ())
                if (only is None or c.default_name in only) and c.applies(report) is None]
        if not able or not counts.get("local"):
            out.append(g["component"])
    return out


def make_agents(spec: str, seed: int, model: str, memory_nonempty: bool = False, *,
                report: dict[str, Any] | None = None, memory: list[dict[str, Any]] | None = None,
                incumbent: Recipe | None = None, only: tuple[str, ...] | None = None,
                skip: tuple[str, ...] = ()) -> list[Agent]:
    """Agents for one round, in the spec's order. Claude agents check ANTHROPIC_API_KEY before anything runs."""
    counts = parse_agents(spec)
    if any(kind == "claude" for kind, _ in counts):
        from specpilot.core.agents.claude import require_api_key

        require_api_key()
    agents: list[Agent] = []
    for kind, count in counts:
        if kind == "claude":
            if skip:
                continue  # a second pass in a round is for local agents not yet tried
            from specpilot.core.agents.claude import ClaudeAgent

            agents += [ClaudeAgent(model=model, name="claude" if count == 1 else f"claude-{i + 1}")
                       for i in range(count)]
        elif memory is not None:
            agents += local_agents_for(report, count, memory, incumbent, seed, only, skip)
        else:
            agents += [cls(seed=seed) for cls in _pick(report, count, memory_nonempty, only, skip)]
    return agents
