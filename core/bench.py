"""Side-by-side benchmark in one process: transformers AR / assisted / prompt lookup, our AR, and recipes.

Systems run interleaved request by request (A B C A B C ...), with the order rotated per request, so
machine drift lands on every system alike. Tokens/s per repeat = tokens emitted / seconds spent over all
requests; the reported figure is the median over repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from specpilot.core.deployment import Deployment
from specpilot.core.engine import Engine
from specpilot.core.engine.decode import DECODE_PHASES, PHASES, sync
from specpilot.core.recipe import Recipe
from specpilot.core.workload import Request, encode, load, split

HF_SYSTEMS = ("hf-ar", "hf-assisted", "hf-assisted-tuned", "hf-lookup")
ASSISTANT_TOKENS = 4  # hf-assisted-tuned: a constant draft of 4 (stock's depth) with no confidence cut-off


@dataclass
class SystemResult:
    name: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)
    speculative: bool = False
    phases: dict[str, float] | None = None  # seconds per phase over every repeat (our systems; None: transformers)

    def add(self, phases: dict[str, float] | None) -> None:
        """Count one request's seconds per phase (None: a system whose phases are not timed)."""
        if phases is not None:
            self.phases = {p: (self.phases or {}).get(p, 0.0) + phases[p] for p in PHASES}

    def to_dict(self, reference: dict[str, list[int]] | None) -> dict:
        rates = [t / s for t, s in zip(self.tokens, self.seconds) if s > 0]
        mismatched = None
        if reference is not None:
            mismatched = sum(1 for rid, out in self.outputs.items() if reference.get(rid) != out)
        return {
            "name": self.name,
            "tokens_per_s": statistics.median(rates) if rates else 0.0,
            "tokens_per_s_min": min(rates) if rates else 0.0,
            "tokens_per_s_max": max(rates) if rates else 0.0,
            "mean_accepted_length": (sum(self.accepted) / len(self.accepted)) if self.speculative and self.accepted else None,
            "requests": len(self.outputs),
            "mismatched_requests": mismatched,
            **phase_fields(self.phases, len(self.seconds), sum(self.tokens)),
        }


def phase_fields(phases: dict[str, float] | None, repeats: int, tokens: int) -> dict:
    """A system's `phases_s` (seconds per phase in one pass over the requests, the mean over the repeats) and
    `decode_ms_per_token` (drafting, verification, commit and host time per new token: the prompt's share left
    out); nothing for a system whose phases are not timed (transformers)."""
    if phases is None or repeats == 0 or tokens == 0:
        return {}
    decode = sum(phases[p] for p in DECODE_PHASES)
    return {"phases_s": {p: v / repeats for p, v in phases.items()}, "decode_ms_per_token": 1e3 * decode / tokens}


class HFSystems:
    """transformers baselines on the same checkpoints and dtype (the stock reference implementation)."""

    def __init__(self, deployment: Deployment) -> None:
        from specpilot.core.hf import hf_model

        self.target = hf_model(deployment.target, deployment.dtype, deployment.device)
        self.drafter = None
        if deployment.drafter:
            self.drafter = hf_model(deployment.drafter, deployment.dtype, deployment.device)
        eos = self.target.generation_config.eos_token_id
        self.pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)

    def _tuned(self, inputs: torch.Tensor, kwargs: dict, prompt_len: int) -> list[int]:
        """Assisted generation with num_assistant_tokens set on the assistant's generation_config (HF's own
        knob: its default schedule starts at 20 and adapts, with a 0.4 confidence cut-off)."""
        gen = self.drafter.generation_config
        saved = (gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold)
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = ASSISTANT_TOKENS, "constant"
        gen.assistant_confidence_threshold = 0.0
        try:
            with torch.inference_mode():
                out = self.target.generate(inputs, **kwargs)
        finally:
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = saved
        return out[0, prompt_len:].tolist()

    def run(self, name: str, ids: list[int], max_new: int) -> list[int]:
        inputs = torch.tensor([ids], device=self.target.device)
        kwargs = {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": self.pad,
                  "attention_mask": torch.ones_like(inputs)}
        if name in ("hf-assisted", "hf-assisted-tuned"):
            kwargs["assistant_model"] = self.drafter
        if name == "hf-assisted-tuned":
            return self._tuned(inputs, kwargs, len(ids))
        elif name == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        with torch.inference_mode():
            out = self.target.generate(inputs, **kwargs)
        return out[0, len(ids):].tolist()


def run(deployment: Deployment, recipes: list[Recipe], which: str = "all", max_requests: int | None = None,
        max_new_tokens: int | None = None, repeats: int = 3, hf: bool = True, progress: bool = True,
        engine: Engine | None = None, hf_systems: tuple[str, ...] = HF_SYSTEMS, our_ar: bool = True) -> dict:
    """Benchmark every system on the same requests; returns the JSON-ready summary. `our_ar=False` skips our
    float32 AR, which on a real model costs as much as the rest of a block-format bench; mismatches are then
    counted against transformers' greedy output, or against AR on the first recipe's weight format."""
    from transformers import AutoTokenizer

    deployment.validate()
    unknown = [n for n in hf_systems if n not in HF_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown transformers system {unknown[0]!r}; known: {', '.join(HF_SYSTEMS)}")
    if not (our_ar or (hf and "hf-ar" in hf_systems) or any(r.weights.format != "native" for r in recipes)):
        raise ValueError("bench: nothing to count mismatches against; keep our AR (drop --no-ar), run hf-ar, or "
                         "bench a recipe on another weight format")
    requests = split(load(deployment.workload), which)[: max_requests or None]
    tokenizer = AutoTokenizer.from_pretrained(deployment.target)
    prompts = {r.id: encode(tokenizer, r) for r in requests}
    limits = {r.id: max_new_tokens or r.max_new_tokens for r in requests}
    engine = engine or Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                                 deployment.numerics)
    runners: dict[str, Callable[[Request], tuple[list[int], float, list[int], dict[str, float] | None]]] = {}
    notes: list[str] = []
    if hf and hf_systems:
        models = HFSystems(deployment)
        names = [n for n in HF_SYSTEMS
                 if n in hf_systems and (models.drafter is not None or not n.startswith("hf-assisted"))]
        if models.drafter is None:
            notes.append("hf-assisted skipped: the deployment has no drafter model (--drafter none)")
        for name in names:
            runners[name] = _hf_runner(models, name, prompts, limits, deployment.device)
    if our_ar:
        runners["ar"] = _our_runner(engine, None, prompts, limits)
    for recipe in recipes:  # AR on a recipe's own weight format too ("ar+gguf"): what the format alone buys
        fmt = recipe.weights.format
        if fmt != "native" and f"ar+{fmt}" not in runners:
            runners[f"ar+{fmt}"] = _our_runner(engine, recipe, prompts, limits, speculative=False)
    reference_name = next(n for n in runners if n in ("hf-ar", "ar") or n.startswith("ar+"))
    for recipe in recipes:
        runners[recipe.name] = _our_runner(engine, recipe, prompts, limits)
    results = {name: SystemResult(name, speculative=name not in HF_SYSTEMS and not name.startswith("ar"))
               for name in runners}
    for runner in runners.values():
        runner(requests[0])
    bar = tqdm(total=repeats * len(requests) * len(runners), desc="bench", file=sys.stderr, disable=not progress)
    order = list(runners)
    for rep in range(repeats):
        totals = {name: [0, 0.0] for name in runners}
        for i, request in enumerate(requests):
            shift = (i + rep) % len(order)
            for name in order[shift:] + order[:shift]:
                tokens, seconds, accepted, phases = runners[name](request)
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
                results[name].outputs[request.id] = tokens
                results[name].accepted.extend(accepted)
                results[name].add(phases)
                bar.update()
        for name, (n, s) in totals.items():
            results[name].tokens.append(n)
            results[name].seconds.append(s)
    bar.close()
    reference = results[reference_name].outputs
    return {
        "deployment": deployment.to_dict(),
        "requests": len(requests),
        "repeats": repeats,
        "reference": reference_name,
        "results": [results[name].to_dict(reference) for name in runners],
        "notes": notes,
    }


def _hf_runner(hf: HFSystems, name: str, prompts: dict, limits: dict, device: str):
    def go(request: Request) -> tuple[list[int], float, list[int], None]:
        sync(device)
        t0 = time.perf_counter()
        tokens = hf.run(name, prompts[request.id], limits[request.id])
        sync(device)
        return tokens, time.perf_counter() - t0, [], None
    return go


def _our_runner(engine: Engine, recipe: Recipe | None, prompts: dict, limits: dict, speculative: bool = True):
    def go(request: Request) -> tuple[list[int], float, list[int], dict[str, float]]:
        result = engine.generate([prompts[request.id]], limits[request.id], recipe,
                                 speculative=speculative and recipe is not None)
        return result.tokens[0], result.seconds, [a for s in result.steps for a in s.accepted], result.phase_seconds()
    return go



def table(summary: dict) -> str:
    """A plain-text table of a bench summary."""
    rows = summary["results"]
    if "batch_sizes" in summary:
        width = max(16, *(len(r["name"]) + 2 for r in rows))
        versus = "vs batched AR" if summary.get("baseline", "ar") == "ar" else f"vs {summary['baseline']}"
        lines = [f"{'batch':>5}  {'system':<{width}}{'tok/s':>9}{versus:>15}{'same runtime':>14}"
                 f"{'accept':>8}{'mismatch':>10}"]
        for r in rows:
            acc = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
            same = f"{r['speedup_vs_ar_same_runtime']:.2f}x" if "speedup_vs_ar_same_runtime" in r else "-"
            lines.append(f"{r['batch_size']:>5}  {r['name']:<{width}}{r['tokens_per_s']:>9.1f}"
                         f"{r['speedup_vs_ar']:>14.2f}x{same:>14}{acc:>8}{r['mismatched_requests']!s:>10}")
        return "\n".join(lines)
    base = next((r["tokens_per_s"] for r in rows if r["name"] == summary["reference"]), None)
    lines = [f"{'system':<18}{'tok/s':>9}{'min':>9}{'max':>9}{'vs ' + summary['reference']:>10}{'accept':>8}"
             f"{'mismatch':>10}"]
    for r in rows:
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        acc = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        lines.append(f"{r['name']:<18}{r['tokens_per_s']:>9.1f}{r['tokens_per_s_min']:>9.1f}"
                     f"{r['tokens_per_s_max']:>9.1f}{speed:>10}{acc:>8}{r['mismatched_requests']!s:>10}")
    lines += [f"note: {n}" for n in summary.get("notes", [])]
    return "\n".join(lines)


def phases_table(summary: dict) -> str:
    """Where each of our systems' time went (seconds in one pass over the requests), beside its decoding rate
    without the prompt: the target's prompt prefill, the drafter's catch-up, drafting, verification, and the
    commit with the host's share."""
    rows = [r for r in summary["results"] if "phases_s" in r]
    width = max(16, *(len(r["name"]) + 2 for r in rows)) if rows else 16
    batch = "batch_sizes" in summary
    lines = [("batch  " if batch else "") + f"{'system':<{width}}{'prefill s':>10}{'catch-up s':>11}{'draft s':>9}"
             f"{'verify s':>10}{'other s':>9}{'decode ms/tok':>15}"]
    for r in rows:
        ph = r["phases_s"]
        lines.append((f"{r['batch_size']:>5}  " if batch else "") + f"{r['name']:<{width}}{ph['prefill']:>10.2f}"
                     f"{ph['catch_up']:>11.2f}{ph['draft']:>9.2f}{ph['verify']:>10.2f}"
                     f"{ph['commit'] + ph['host']:>9.2f}{r['decode_ms_per_token']:>15.1f}")
    return "\n".join(lines)
