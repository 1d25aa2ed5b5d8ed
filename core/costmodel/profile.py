"""Step profile of a recipe: where a real run's time goes, and what verifying and drafting cost by shape.

A timed run gives the phase means (draft, verify, commit, host) from the engine's StepStats and the wall
time outside steps (prefill, cache allocation). Microbenchmarks at a realistic prefix length give the
verification cost curve (target forward for 1..64 nodes, under every linear backend), the drafter's forward
cost per width (also under every backend: it runs on the recipe's), and real `draft()` calls for chains of
several depths, whose intercept and slope are the per-call and per-level host work on top of the forwards.
Prediction (predict.py) composes any recipe's step from these.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from specpilot.core import progress
from specpilot.core.engine import Engine, StepStats
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.decode import sync
from specpilot.core.engine.numerics import NumericsError, check_recipe as check_numerics
from specpilot.core.engine.drafters import DraftMode, ModelDrafter, TreeSpec
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.tree import chain_paths
from specpilot.core.mechanisms import curve, own_curves
from specpilot.core.recipe import Recipe, RecipeError

# dense where chains and trees live: the curve is lumpy there (5 = a chain of 4 and its root, which the q8 and
# float32 kernels' row blocking can make cheaper than 4 rows; interpolating 4..6 would misprice it)
NODES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
CHAIN_DEPTHS = (1, 2, 4, 8)
DYNAMIC_SHAPE = (6, 4, 24)
DRAFTER_WIDTHS = (1, 4, 16)
BIG_MODEL_BYTES = 1 << 30  # a target reading more than this per forward is profiled with fewer repeats
DISPATCH = " dispatch"  # forward_curves key of the forward without weight products (no backend has a space)


@dataclass
class RunStats:
    """A timed run, one request at a time: outputs, every step's record, per-request wall seconds."""

    tokens: list[list[int]]
    steps: list[StepStats]
    seconds: list[float]
    accepted: list[list[int]]

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclass
class Profile:
    """Measured phase costs of one recipe plus the cost curves predict.py needs (ms throughout).

    phases: mean ms per step; other_ms: total wall time outside steps (prefill, allocation);
    verify_curve: nodes -> target forward; backend_curves: the same curve under every runtime.linear (and
    "gguf": weights read as stored)
    backend this device runs; drafters: per drafter ("model", "early_exit:E") its forward per width
    (curve), real draft() calls per chain depth (chain), their fit (fixed_ms per call, level_ms per level
    beyond the forward), a dynamic tree's extra per level, and its prompt prefill (prefill_ms); bytes:
    what one verify step reads (weights + KV at context_len); dispatch_curve: nodes -> the same target
    forward with every weight product removed (outputs allocated, not computed), i.e. what a forward costs
    outside its weight matrices: op dispatch and the small ops (norms, RoPE, attention at these sizes);
    numerics: the deployment's (core/engine/numerics.py) whose target these curves timed; under q8 only the
    variants that keep its products are measured (profiles stored before numerics existed are f32).
    """

    recipe: dict
    requests: int
    tokens: int
    steps: int
    wall_ms: float
    phases: dict[str, float]
    other_ms: float
    mean_accepted_length: float
    tokens_per_step: float
    nodes_per_step: float
    prompt_len: float
    context_len: int
    target_layers: int
    verify_curve: dict[int, float]
    drafters: dict[str, dict] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    backend_curves: dict[str, dict[int, float]] = field(default_factory=dict)
    dispatch_curve: dict[int, float] = field(default_factory=dict)
    drafter_backend_curves: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    numerics: str = "f32"

    def verify_curve_for(self, backend: str) -> dict[int, float]:
        """The target's forward curve under a linear backend (the profiled recipe's when not measured)."""
        return self.backend_curves.get(backend, self.verify_curve)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """Inverse of to_dict, also after a JSON round trip (curve keys come back as strings)."""
        data = dict(data)
        data["verify_curve"] = _int_keys(data["verify_curve"])
        data["backend_curves"] = {k: _int_keys(c) for k, c in data.get("backend_curves", {}).items()}
        data["dispatch_curve"] = _int_keys(data.get("dispatch_curve", {}))
        data["drafters"] = {kind: {**d, "curve": _int_keys(d["curve"]), "chain": _int_keys(d["chain"])}
                            for kind, d in data.get("drafters", {}).items()}
        data["drafter_backend_curves"] = {b: {k: _int_keys(c) for k, c in kinds.items()}
                                          for b, kinds in data.get("drafter_backend_curves", {}).items()}
        data["numerics"] = data.get("numerics") or "f32"
        return cls(**data)


def _int_keys(curve: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in curve.items()}



def median_ms(fns: dict, device: torch.device, repeats: int) -> dict:
    """Median wall ms of each callable after a warm-up round; rounds go over all callables in turn, so a
    burst of load on a shared machine lands on every key alike (medians, never means)."""
    times: dict = {k: [] for k in fns}
    for r in range(repeats + 1):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def interpolate(curve: dict[int, float], x: float) -> float:
    """Piecewise-linear in x between measured points; linear extrapolation beyond the last two."""
    xs = sorted(curve)
    if not xs:
        return 0.0
    if len(xs) == 1 or x <= xs[0]:
        return curve[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (x - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return curve[hi] + (curve[hi] - curve[lo]) * (x - hi) / (hi - lo)


def timed_run(engine: Engine, recipe: Recipe | None, prompts: list[list[int]], limits: list[int],
              request_ids: list[int] | None = None, passes: int = 1) -> RunStats:
    """Run each request alone (batch 1) after one warm-up; recipe None is plain autoregressive decoding.
    With several passes over the requests the fastest pass is kept: load on a shared machine only ever adds
    time, so the fastest pass is the least disturbed record of where a step's time goes."""
    ids = request_ids if request_ids is not None else list(range(len(prompts)))
    spec = recipe is not None
    engine.generate([prompts[0]], [min(limits[0], 8)], recipe, [ids[0]], speculative=spec)
    best = None
    with progress.step("timing requests", max(1, passes) * len(prompts)):
        for _ in range(max(1, passes)):
            run = RunStats([], [], [], [])
            for prompt, limit, rid in zip(prompts, limits, ids):
                result = engine.generate([prompt], [limit], recipe, [rid], speculative=spec)
                run.tokens.append(result.tokens[0])
                run.steps.extend(result.steps)
                run.seconds.append(result.seconds)
                run.accepted.append([a for s in result.steps for a in s.accepted])
                progress.advance()
            if best is None or sum(run.seconds) < sum(best.seconds):
                best = run
    return best


def weight_bytes(model: Transformer) -> int:
    """Parameter bytes a forward of `model` reads (tied embeddings once, as the head): weight matrices at the
    bits its projections read (12 for packed12, 16 for the skinny kernel's bf16 panels, the stored blocks
    for gguf), the rest at its dtype."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None, matrix: bool = False) -> None:
        nonlocal total
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        if matrix and model.matrix_bits:
            nbytes = t.numel() * model.matrix_bits // 8
        total += nbytes

    c = model.cfg
    stored = getattr(model, "matrix_bytes", None)
    if stored:
        total += stored
        seen.add(id(model.lm_head_weight))
    add(model.lm_head_weight, matrix=True)  # first: a tied embedding is read as the LM head's matrix
    seen.add(id(model.embed))  # an untied embedding is a lookup: a step reads a row per token, not the matrix
    add(model.norm)
    for layer in model.layers:
        for t in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm):
            add(t)
        for key, t in layer.raw.items():
            if stored and key != "qkv_bias":
                continue
            add(t, matrix=True)
        if c.attention_bias:
            total += (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * model.embed.element_size()
    return total


def kv_bytes(model: Transformer, context: int) -> int:
    """Keys and values a step reads at `context` tokens: layers * 2 * kv_heads * head_dim * bytes * context."""
    c = model.cfg
    return model.num_layers * 2 * c.num_kv_heads * c.head_dim * model.embed.element_size() * context


def _filled_cache(model: Transformer, context: int, extra: int):
    dev = model.device
    cache = model.new_cache(1, context + extra + 2)
    toks = torch.randint(0, model.cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    causal = torch.tril(torch.ones(context, context, dtype=torch.bool, device=dev))[None]
    with torch.inference_mode():
        model.step(toks.to(dev), cache, cache.lengths, torch.arange(context, device=dev)[None], causal,
                   logits_at=torch.zeros(1, 0, dtype=torch.long, device=dev))
    cache.lengths.fill_(context)
    return cache


def forward_curve(model: Transformer, context: int, widths: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median ms of one forward of w tree nodes (a chain mask) on a `context`-token prefix, per width."""
    return forward_curves({"": model}, context, widths, repeats)[""]


def forward_curves(models: dict[str, Transformer], context: int, widths: tuple[int, ...],
                   repeats: int) -> dict[str, dict[int, float]]:
    """forward_curve of several models (one target under different linear backends), timed in the same
    interleaved rounds so that a change of load cannot favour one of them."""
    fns = {}
    for name, model in models.items():
        dev = model.device
        cache = _filled_cache(model, context, max(widths))
        for w in widths:
            toks = torch.randint(0, model.cfg.vocab_size, (1, w), generator=torch.Generator().manual_seed(w)).to(dev)
            depths = torch.arange(w, device=dev)[None]
            anc = None if w == 1 else torch.tril(torch.ones(w, w, dtype=torch.bool, device=dev))[None]
            fns[(name, w)] = partial(model.step, toks, cache, cache.lengths, depths, anc)
    device = next(iter(models.values())).device
    with torch.inference_mode():
        times = median_ms(fns, device, repeats)
    return {name: {w: times[(name, w)] for w in widths} for name in models}


def draft_calls(model: Transformer, prompt: list[int], repeats: int,
                dynamic: tuple[int, int, int]) -> tuple[dict[int, float], float]:
    """Median ms of real draft() calls: chains of CHAIN_DEPTHS, and one dynamic (depth, topk, budget) tree."""
    drafter = ModelDrafter(model)
    mode = DraftMode()
    drafter.reset([prompt], len(prompt) + 2 * max(CHAIN_DEPTHS) + 2 * dynamic[2] + 8)
    with torch.inference_mode():
        tree = drafter.draft(TreeSpec("static", chain_paths(1)), mode, [True])[0]
        drafter.commit([0], [[]], [[tree.tokens[-1]]])
        depth, topk, budget = dynamic
        specs = {d: TreeSpec("static", chain_paths(d)) for d in CHAIN_DEPTHS}
        specs["dynamic"] = TreeSpec("dynamic", depth=depth, topk=topk, budget=budget)
        ms = median_ms({k: partial(drafter.draft, spec, mode, [True]) for k, spec in specs.items()}, model.device,
                       repeats)
    dyn = ms.pop("dynamic")
    return ms, dyn


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """Theil-Sen intercept and slope of ms against depth (robust to one noisy point on a shared machine)."""
    xs = sorted(points)
    slopes = [(points[b] - points[a]) / (b - a) for i, a in enumerate(xs) for b in xs[i + 1:]]
    slope = statistics.median(slopes) if slopes else 0.0
    return statistics.median(points[x] - slope * x for x in xs), slope


def drafter_models(engine: Engine, recipe: Recipe) -> dict[str, Transformer]:
    """Drafter networks worth costing: the drafter checkpoint and the target's early exit (the recipe's
    exit layer, else half the layers), keyed "model" and "early_exit:E"."""
    target, drafter = engine.models_for(recipe)
    layers = recipe.draft.exit_layers(target.cfg.num_layers)
    out = {"model": drafter} if drafter is not None else {}
    if 0 < layers < target.cfg.num_layers:
        out[f"early_exit:{layers}"] = target.truncated(layers)
    return out


def drafter_costs(model: Transformer, context: int, prompt: list[int], widths: tuple[int, ...], repeats: int,
                  dynamic: tuple[int, int, int]) -> dict:
    """Forward ms per width, real draft() ms per chain depth, their fit, a dynamic tree's extra, prefill."""
    curve = forward_curve(model, context, widths, repeats)
    chain, dyn_ms = draft_calls(model, prompt, repeats, dynamic)
    fixed, per_level = _fit(chain)
    level = per_level - curve[1]
    depth, topk, budget = dynamic
    modelled = fixed + depth * level + curve[1] + (depth - 1) * interpolate(curve, topk)
    return {
        "curve": curve,
        "chain": chain,
        "fixed_ms": fixed,
        "level_ms": level,
        "dynamic": {"depth": depth, "topk": topk, "budget": budget, "ms": dyn_ms,
                    "extra_ms_per_level": (dyn_ms - modelled) / depth},
        "prefill_ms": forward_curve(model, 1, (len(prompt),), 3)[len(prompt)],
    }


def without_products(model: Transformer) -> Transformer:
    """`model` with every weight product giving zeros (Transformer.without_products; the fused layer skips
    them in C): its forward times everything but the weight products."""
    return model.without_products()


def variant_key(recipe: Recipe) -> str:
    """Which measured forward curve prices `recipe`: its weight format's own ("gguf": weights read as stored,
    by that format's kernel, on no linear backend), else its linear backend's."""
    return curve("weight_format", recipe.weights.format) or curve("linear_backend", recipe.runtime.linear) \
        or recipe.runtime.linear


def drafter_variant_key(recipe: Recipe) -> str:
    """Which measured drafter curves price `recipe`'s drafter model: the target's variant, plus the drafter's
    own format when it has one ("gguf+q4")."""
    key = variant_key(recipe)
    form = curve("drafter_format", recipe.weights.drafter_format)
    return f"{key}+{form}" if form else key


def variants(engine: Engine, recipe: Recipe) -> dict[str, Recipe]:
    """The recipe under every linear backend (with a weight format that runs on one), and switched to every
    weight format that runs its own kernel (gguf: target and drafter): the alternatives the cost model prices.
    A format this checkpoint cannot take (gguf from a Hugging Face directory) fails to load where it is
    measured, and is left out there. A variant the deployment's numerics refuses (under q8: another linear
    backend, a target format other than native or gguf) is no alternative at all and is left out here."""
    fmt = "native" if curve("weight_format", recipe.weights.format) else recipe.weights.format
    out = {}
    for key, backend in own_curves("linear_backend").items():
        try:
            out[key] = recipe.replace(weights={"format": fmt, "drafter_format": "same"}, runtime={"linear": backend})
        except RecipeError:
            continue
    for key, name in own_curves("weight_format").items():
        try:
            out[key] = recipe.switched("weight_format", name).replace(weights={"drafter_format": "same"})
        except RecipeError:
            continue
    return {key: r for key, r in out.items() if allowed(engine, r)}


def allowed(engine: Engine, recipe: Recipe) -> bool:
    """Whether the engine's numerics let `recipe` set the target's weight format and linear backend."""
    try:
        check_numerics(getattr(engine, "numerics", "f32"), recipe.weights.format, recipe.runtime.linear)
    except NumericsError:
        return False
    return True


def drafter_format_variants(engine: Engine, recipe: Recipe, keys: list[str]) -> dict[str, Recipe]:
    """For each target variant in `keys`, the recipe with its drafter model in every approximate drafter
    format that fits in a quarter of the memory available ("gguf+q4": gguf target, 4-bit drafter)."""
    from specpilot.core.engine.ram_budget import available_bytes

    if engine.drafter_model is None or recipe.draft.method != "model":
        return {}
    avail = available_bytes()
    options = variants(engine, recipe)
    out = {}
    for key in keys:
        for suffix, form in own_curves("drafter_format").items():
            if key not in options:
                continue
            try:
                variant = options[key].switched("drafter_format", form)
            except RecipeError:
                continue
            if avail is not None and engine.packed_bytes(variant) > avail / 4:
                continue
            out[f"{key}+{suffix}"] = variant
    return out


def backend_targets(engine: Engine, recipe: Recipe) -> dict[str, Transformer]:
    """The recipe's target under every variant (see `variants`) that runs on this device and dtype, and
    whose packed copies take at most a quarter of the memory available (the profiling process shares the
    machine with the reference and the judge's workers: a 1.5B model's float32 copies are 7 GB each)."""
    from specpilot.core.engine.ram_budget import available_bytes

    targets = {}
    avail = available_bytes()
    mine = variant_key(recipe)
    for key, variant in variants(engine, recipe).items():
        if key != mine and avail is not None and engine.packed_bytes(variant) > avail / 4:
            continue
        try:
            targets[key] = engine.target_for(variant)
        except ModelLoadError:
            if key == mine:
                raise
    return targets


def _distinct(models: dict[str, Transformer]) -> dict[str, Transformer]:
    """The first key of each distinct model object (one forward curve per model, however many keys)."""
    out: dict[str, Transformer] = {}
    for key, model in models.items():
        if all(m is not model for m in out.values()):
            out[key] = model
    return out


def profile(engine: Engine, recipe: Recipe, prompts: list[list[int]], limits: list[int],
            run: RunStats | None = None, request_ids: list[int] | None = None, repeats: int = 7) -> Profile:
    """Profile `recipe` on the requests (timing them unless `run` is given) and measure the cost curves."""
    run = run or timed_run(engine, recipe, prompts, limits, request_ids)
    target = engine.target_for(recipe)
    if weight_bytes(engine.target) > BIG_MODEL_BYTES:
        repeats = min(repeats, 3)  # each forward is tens of ms or more: 3 medians suffice, 7 cost minutes
    steps = run.steps
    n = max(len(steps), 1)
    phases = {k: sum(getattr(s, k) for s in steps) / n for k in ("draft_ms", "verify_ms", "commit_ms", "host_ms")}
    wall_ms = 1e3 * sum(run.seconds)
    accepted = [a for acc in run.accepted for a in acc]
    prompt_len = statistics.fmean(len(p) for p in prompts)
    out_len = statistics.fmean(len(t) for t in run.tokens) if run.tokens else 0.0
    context = max(1, round(prompt_len + out_len / 2))
    context = min(context, target.cfg.max_position_embeddings - max(NODES) - 2)
    targets = backend_targets(engine, recipe)
    curves = forward_curves({**_distinct(targets), DISPATCH: without_products(target)}, context, NODES, repeats)
    for key, model in targets.items():  # variants sharing one target model share its curve
        curves.setdefault(key, curves[next(k for k, m in targets.items() if m is model)])
    dispatch = curves.pop(DISPATCH)
    weights = weight_bytes(target)
    fewest = min(weight_bytes(t) for t in targets.values())
    kv = kv_bytes(target, context)
    prof = Profile(
        recipe=recipe.to_dict(),
        requests=len(run.tokens),
        tokens=run.new_tokens,
        steps=len(steps),
        wall_ms=wall_ms,
        phases=phases,
        other_ms=wall_ms - sum(phases.values()) * len(steps),
        mean_accepted_length=sum(accepted) / len(accepted) if accepted else 0.0,
        tokens_per_step=run.new_tokens / n,
        nodes_per_step=sum(s.nodes for s in steps) / n,
        prompt_len=prompt_len,
        context_len=context,
        target_layers=target.num_layers,
        verify_curve=curves[variant_key(recipe)],
        bytes={"weights": weights, "kv": kv, "total": weights + kv, "context_len": context, "fewest_weights": fewest},
        backend_curves=curves,
        dispatch_curve=dispatch,
        numerics=getattr(engine, "numerics", "f32"),
    )
    widths = tuple(sorted({1, 2, 3, 4, 6, 8, 12, 16, recipe.tree.topk}))
    prompt = max(prompts, key=len)[: max(2, round(prompt_len))]
    dynamic = ((recipe.tree.depth, recipe.tree.topk, recipe.tree.budget) if recipe.tree.policy == "dynamic"
               else DYNAMIC_SHAPE)
    for kind, model in drafter_models(engine, recipe).items():
        prof.drafters[kind] = drafter_costs(model, context, prompt, widths, repeats, dynamic)
    if prof.drafters:
        own = [k for k in dict.fromkeys((variant_key(recipe), *own_curves("weight_format"))) if k in curves]  # not every backend
        formats = drafter_format_variants(engine, recipe, own)
        options = {**variants(engine, recipe), **formats}
        drafters = {}
        for key in [*curves, *formats]:  # the measured targets' variants only
            try:
                models = drafter_models(engine, options[key])
            except ModelLoadError:  # a drafter format this drafter checkpoint cannot take: left out
                if key in curves and key == variant_key(recipe):
                    raise
                continue
            drafters.update({f"{key}|{kind}": model for kind, model in models.items()
                             if key in curves or kind == "model"})
        timed = forward_curves(drafters, context, DRAFTER_WIDTHS, repeats)
        for key, curve in timed.items():
            backend, kind = key.split("|", 1)
            prof.drafter_backend_curves.setdefault(backend, {})[kind] = curve
    return prof
