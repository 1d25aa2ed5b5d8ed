"""Drift: how far a deployment's greedy output is from transformers float32 on the same requests.

Under the q8 numerics (core/engine/numerics.py) speculation is exact against our own q8 plain decoding, and
that decoding is not transformers float32: its activations are rounded to 8 bits. This module measures what
that costs in fidelity, for any token source (our q8 plain decoding, llama.cpp's greedy output, ...): one
teacher-forced transformers float32 forward per request over prompt + output (token forcing, core/forcing.py,
with the f32 reference and its near-tie threshold `EPSILON`), and at every output position whether
float32's argmax is the token that was emitted.

A request differs (`RequestDrift.differs`) iff it has at least one mismatch position, and for greedy
decoding that is exactly "its greedy text differs from transformers' greedy text" (as token sequences, same
length limit): if every emitted token is float32's argmax given the emitted prefix, then by induction the
output IS transformers' own greedy continuation; if the first mismatch is at k, the prefixes agree up to k
and transformers' own greedy takes a different token at k (the argmax there), so the two outputs differ at
token k. Later mismatches are counted too (the per-token rate) but are conditioned on a prefix transformers
would not have produced; the rate is a forcing rate, not a text distance.

Nothing here imports torch or transformers at module level, so the dashboard can import `describe`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class RequestDrift:
    """One request: output tokens forced, how many disagree with float32's argmax, how many of those at a
    near-tie (float32 top-2 logit gap below forcing's EPSILON), and the first disagreeing output position."""

    tokens: int
    mismatches: int
    near_ties: int
    first: int | None

    @property
    def differs(self) -> bool:
        return self.mismatches > 0


@dataclass(frozen=True)
class Drift:
    """Drift of one token source from transformers float32 over a set of requests."""

    requests: list[RequestDrift] = field(default_factory=list)
    epsilon: float = 0.05

    @property
    def differing(self) -> int:
        """Requests whose greedy output differs from transformers float32's (see the module docstring)."""
        return sum(r.differs for r in self.requests)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def mismatches(self) -> int:
        return sum(r.mismatches for r in self.requests)

    @property
    def near_ties(self) -> int:
        return sum(r.near_ties for r in self.requests)

    @property
    def rate(self) -> float:
        """Mismatches per forced output token."""
        return self.mismatches / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: totals, then one entry per request."""
        return {"reference": "transformers float32", "requests": len(self.requests), "differing": self.differing,
                "tokens": self.tokens, "mismatches": self.mismatches, "rate": self.rate,
                "near_ties": self.near_ties, "epsilon": self.epsilon,
                "per_request": [{"tokens": r.tokens, "mismatches": r.mismatches, "near_ties": r.near_ties,
                                 "first": r.first} for r in self.requests]}


def load_f32_reference(target_dir: str | os.PathLike, device: str = "cpu") -> Any:
    """The transformers float32 model of the target checkpoint, loaded as token forcing loads its f32
    reference (core/forcing.load_reference, without an engine: the transformers model, never our own)."""
    from specpilot.core.forcing import load_reference

    return load_reference(str(target_dir), "float32", device)


def drift(target: str | os.PathLike | Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
          device: str = "cpu") -> Drift:
    """The drift of `outputs` (the tokens some greedy decoder emitted after each prompt) from transformers
    float32: one teacher-forced float32 forward per request over prompt + output.

    `target` is the target checkpoint directory (its transformers float32 model is loaded here) or that model
    already loaded (`load_f32_reference`), to force several token sources against one load. Every emitted
    token is checked, whatever it is (an EOS included); an empty output checks nothing.
    """
    from specpilot.core.engine.decode import Verification
    from specpilot.core.forcing import EPSILON, force

    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts and {len(outputs)} outputs: one output per prompt")
    reference = load_f32_reference(target, device) if isinstance(target, (str, os.PathLike)) else target
    per = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        out = [int(t) for t in out]
        # limit = the output's own length and no EOS handling: no truncation or padding to count, only choices
        res = force(reference, [list(prompt)], [out], [len(out)], Verification(), [i], ())
        wrong = res.first[0]
        per.append(RequestDrift(res.tokens, res.mismatches, res.near_ties, wrong[0] if wrong else None))
    return Drift(per, EPSILON)


def describe(d: dict[str, Any], numerics: str | None = None, short: bool = False) -> str:
    """One line from `Drift.to_dict()` (its "numerics" key, set by the cost report, names the deployment's
    numerics unless `numerics` does): the full one for `specpilot profile`, `short` for the dashboard."""
    name = numerics or d.get("numerics") or "q8"
    if short:
        return (f"{name} drift vs f32: {d['differing']}/{d['requests']} requests differ · {d['mismatches']}/"
                f"{d['tokens']} tokens ({100 * d['rate']:.2f}%) mismatch · {d['near_ties']} near-ties")
    return (f"{name} drift from transformers float32: {d['differing']} of {d['requests']} requests differ, "
            f"{d['mismatches']} of {d['tokens']} tokens ({100 * d['rate']:.2f}%) mismatch under forcing "
            f"({d['near_ties']} near-ties)")
