"""What one speculative step is made of: verification rules, the cache commit, and the rules that end a request.

The step itself (draft -> verify -> accept -> commit) is written once, in core/engine/scheduler.py, and every
caller runs it there: a server's scheduler, and `generate` for a fixed batch. Autoregressive decoding is the
same step with a root-only tree, so both share every line that touches the cache. Verification rules:
  greedy     accept the longest path whose tokens equal the target's argmax, plus the bonus token;
  seeded     the same with the target's choice = argmax(logits/T + gumbel(seed, request, position));
  rejection  standard speculative sampling on a chain (accept with min(1, p/q), else resample p - q).
Each rule is an `AcceptanceRule` registered under kind "acceptance" (core/engine/builtins.py); the step looks
the recipe's rule up in the registry, so a plugin rule runs through exactly that step. A draft-length policy
(kind "draft_length") may shorten each step's draft from the row's recent acceptance.
Tie policy: the target's choice is torch.argmax over its logits in the run's dtype (the first index wins
an exact tie); near-ties that flip between kernels of different shapes are counted apart by forcing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

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
    catch_up_ms: float = 0.0  # the drafter fed what rows owed it before the step drafted (not in host_ms)
    caught_up: int = 0  # the owed tokens it fed
    drafting: int = 0  # rows the step drafted for (the others decoded a token plainly)


PHASES = ("prefill", "catch_up", "draft", "verify", "commit", "host")  # where a step's time goes (StepStats)
DECODE_PHASES = PHASES[2:]  # a step's own work: its prompt chunks and the drafter's catch-up left out


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    steps: list[StepStats]
    seconds: float

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds in each of PHASES over every step: the target's prompt prefill, the drafter's catch-up (prompts
        it had not read, tokens emitted while it drafted nothing), drafting, verification, the caches' commit and
        the host's share of the step. What `seconds` holds beyond their sum was spent outside the steps."""
        return {p: sum(getattr(s, f"{p}_ms") for s in self.steps) / 1e3 for p in PHASES}

    def decode_seconds(self) -> float:
        """Seconds in the steps' own work (DECODE_PHASES): the prompt's prefill and the drafter's catch-up left out."""
        return sum(sum(getattr(s, f"{p}_ms") for p in DECODE_PHASES) for s in self.steps) / 1e3

    def summary(self) -> dict:
        accepted = [a for s in self.steps for a in s.accepted]
        phases = {f"{p}_ms": sum(getattr(s, f"{p}_ms") for s in self.steps) for p in PHASES}
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
PackedChoices = Choices  # the same, from the real nodes' logits alone: [N, V], each row's len(tree) nodes in turn
Accept = Callable[[DraftTree, object, torch.Generator], tuple[list[int], int]]
DraftLength = Callable[[int, list[int]], int]


@dataclass(frozen=True)
class AcceptanceRule:
    """How verification decides: `choices` turns the target's logits [B, T, V] over every row's tree into
    a per-row choice (ids, probabilities, ...); `accept` walks one row's tree with its choice and returns
    the accepted node path and the bonus token. `batched`: continuous batching may serve it. `packed`, where
    given, makes the same choices (each row's list as long as its tree) from the real nodes' logits alone,
    [N, V] in row order: verify then never builds the padded [B, T, V] of rows of mixed depths."""

    choices: Choices
    accept: Accept
    batched: bool = False
    packed: PackedChoices | None = None


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work, so a host timer measures it (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_room(nodes: int) -> int:
    """Target cache positions needed past the longest request when steps verify trees of up to `nodes`
    nodes: a step's tree is written after the committed prefix before it is compacted, plus root and bonus."""
    return 2 * nodes + 4


def drafter_room(nodes: int) -> int:
    """Drafter cache positions needed past the target's: one drafted tree ahead, plus root and bonus."""
    return nodes + 2


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


def verify(target: Transformer, cache, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
           lengths: list[int], rule: AcceptanceRule | None = None) -> list:
    """One target forward over every row's tree; the target's choice at every node (by the recipe's rule)."""
    rule = rule or lookup("acceptance", ver.sampling)
    tokens, depths, anc = batch_tensors(trees, target.device)
    B, T = tokens.shape
    logits = target.step(tokens, cache, cache.lengths, depths, None if B == 1 and T == 1 else anc,
                         sizes=[len(t) for t in trees], packed=rule.packed is not None)
    return (rule.choices if rule.packed is None else rule.packed)(logits, trees, ver, req, lengths)


def by_row(flat: list, trees: list[DraftTree]) -> list[list]:
    """Per-node values in row order (a packed verify's) split into each row's list, as long as its tree."""
    out, at = [], 0
    for t in trees:
        out.append(flat[at:at + len(t)])
        at += len(t)
    return out


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


def greedy_packed(logits: torch.Tensor, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
                  lengths: list[int]) -> list:
    """greedy_choices from the real nodes' logits [N, V]."""
    return by_row(logits.argmax(-1).tolist(), trees)


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


def seeded_packed(logits: torch.Tensor, trees: list[DraftTree], ver: Verification, req: torch.Tensor,
                  lengths: list[int]) -> list:
    """seeded_choices from the real nodes' logits [N, V]."""
    positions = torch.tensor([lengths[b] + d + 1 for b, t in enumerate(trees) for d in t.depths])
    requests = torch.cat([req[b:b + 1].expand(len(t)) for b, t in enumerate(trees)])
    scores = seeded_scores(logits, ver.temperature, ver.top_p, ver.seed, requests, positions)
    return by_row(scores.argmax(-1).tolist(), trees)
