"""`specpilot bench --batch-sizes`: aggregate tokens/s under continuous batching, per batch size.

For each batch size every system serves the same requests with at most that many in flight; systems are
interleaved per repeat so drift cancels. Speedups are over our batched autoregressive decoding at the same
batch size (`speedup_vs_ar`, default runtime). A recipe with another weight format or linear backend also
gets `speedup_vs_ar_same_runtime`, over batched AR on that format and backend (system "ar+gguf",
"ar+onednn"), which is what its speculation and batching policy alone earn. Batching policies price steps
with their recipe's cost table (its target, linear backend and drafter), measured once at the start.
"""

from __future__ import annotations

import statistics
import sys

from tqdm import tqdm

from specpilot.core.bench import phase_fields
from specpilot.core.deployment import Deployment
from specpilot.core.engine import Engine
from specpilot.core.recipe import Recipe
from specpilot.core.workload import encode, load, split


def same_runtime(recipe: Recipe) -> str | None:
    """The batched-AR system on a recipe's own weight format and linear backend ("ar+gguf", "ar+onednn",
    "ar+gguf+fused"), None when both are native: what its speculation and batching alone earn is over that."""
    parts = [p for p in (recipe.weights.format, recipe.runtime.linear) if p != "native"]
    return "ar+" + "+".join(parts) if parts else None


def run_batched(deployment: Deployment, recipes: list[Recipe], batch_sizes: list[int], which: str = "all",
                max_requests: int | None = None, max_new_tokens: int | None = None, repeats: int = 3,
                progress: bool = True, engine: Engine | None = None, our_ar: bool = True) -> dict:
    """`our_ar=False` drops our float32 batched AR and the float32 batch-1 reference (on a real model they cost
    more than the rest): speedups are then over batched AR on the first recipe's weight format and linear
    backend, and mismatches are counted against that system's batch-1 output."""
    from transformers import AutoTokenizer

    deployment.validate()
    plain = [r.name for r in recipes if not same_runtime(r)]
    if not our_ar and (plain or not recipes):
        what = f"recipe {plain[0]} runs on float32 weights, whose baseline is our float32 AR" if plain else \
            "no recipe given, so no AR on another weight format to compare with"
        raise ValueError(f"bench --no-ar: {what}; drop --no-ar or bench only recipes with another weight format "
                         "or linear backend")
    requests = split(load(deployment.workload), which)[: max_requests or None]
    tokenizer = AutoTokenizer.from_pretrained(deployment.target)
    prompts = [encode(tokenizer, r) for r in requests]
    limits = [max_new_tokens or r.max_new_tokens for r in requests]
    engine = engine or Engine.load(deployment.target, deployment.drafter, deployment.dtype, deployment.device,
                                 deployment.numerics)
    for recipe in recipes:
        if recipe.batching.policy != "fixed":
            engine.cost_table(recipe, batch_sizes)
    runtimes = {same_runtime(r): r for r in recipes if same_runtime(r)}
    baseline = "ar" if our_ar else same_runtime(recipes[0])
    systems: dict[str, Recipe | None] = {**({"ar": None} if our_ar else {}), **runtimes, **{r.name: r for r in recipes}}
    reference = engine.serve(prompts, limits, None, 1).tokens if our_ar else None
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    rates: dict[tuple[int, str], list[float]] = {}
    accepted: dict[tuple[int, str], list[int]] = {}
    phases: dict[tuple[int, str], dict[str, float]] = {}
    tokens: dict[tuple[int, str], int] = {}
    bar = tqdm(total=repeats * len(batch_sizes) * len(systems), desc="bench", file=sys.stderr, disable=not progress)
    for rep in range(repeats):
        for b in batch_sizes:
            names = list(systems)
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                result = engine.serve(prompts, limits, systems[name], b, speculative=name not in runtimes)
                key = (b, name)
                rates.setdefault(key, []).append(result.new_tokens / result.seconds)
                accepted.setdefault(key, []).extend(a for s in result.steps for a in s.accepted)
                outputs[key] = result.tokens
                tokens[key] = tokens.get(key, 0) + result.new_tokens
                phases[key] = {p: phases.get(key, {}).get(p, 0.0) + v for p, v in result.phase_seconds().items()}
                bar.update()
    bar.close()
    if reference is None:
        reference = outputs.get((1, baseline)) or engine.serve(prompts, limits, runtimes[baseline], 1,
                                                               speculative=False).tokens
    mismatched = {key: sum(1 for x, y in zip(tokens, reference) if x != y) for key, tokens in outputs.items()}
    results = []
    for b in batch_sizes:
        ar = statistics.median(rates[(b, baseline)])
        for name, recipe in systems.items():
            r = rates[(b, name)]
            acc = accepted[(b, name)]
            speculative = recipe is not None and name not in runtimes
            entry = {"name": name, "batch_size": b, "tokens_per_s": statistics.median(r),
                     "tokens_per_s_min": min(r), "tokens_per_s_max": max(r),
                     "speedup_vs_ar": statistics.median(r) / ar,
                     "mean_accepted_length": sum(acc) / len(acc) if speculative else None,
                     "requests": len(prompts), "mismatched_requests": mismatched[(b, name)],
                     **phase_fields(phases[(b, name)], repeats, tokens[(b, name)])}
            if speculative and same_runtime(recipe):
                same = statistics.median(rates[(b, same_runtime(recipe))])
                entry["speedup_vs_ar_same_runtime"] = statistics.median(r) / same
            results.append(entry)
    return {"deployment": deployment.to_dict(), "requests": len(prompts), "repeats": repeats,
            "reference": "ar" if our_ar else f"{baseline} at batch 1", "baseline": baseline,
            "batch_sizes": batch_sizes, "results": results}
