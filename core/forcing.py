"""Token forcing: re-score every emitted token with the stock reference (transformers) and count mismatches.

One reference forward over prompt + output per request; at each output position the reference's choice is
argmax(logits), or for seeded sampling argmax(filtered(logits / T, top_p) + gumbel(seed, request,
position)) keyed exactly as the engine keys it (position = the absolute index of the chosen token, i.e.
prompt length + output index). A request's output is also checked for its length: a truncated output
(shorter than max_new_tokens without a final EOS) counts each missing token as a mismatch, and a padded one
(tokens after an EOS, or past max_new_tokens) counts each extra token as a mismatch.

EPSILON = 0.05: a mismatch where the reference's top-2 margin (logits, or perturbed scores when seeded)
is below it is a near-tie, counted apart. bfloat16 keeps 8 significant bits, so one rounding of a logit
of magnitude 8-16 (typical for small models) moves it by 0.03-0.06; a smaller margin can flip on rounding
alone, while float32 runtimes differ from the reference by ~1e-5 and flip only far inside it. A mismatch at
a larger margin is a clear one.

A recipe passes when its mismatch rate <= stock's rate (measured in the same run, on the same requests)
+ 0.5 percentage points.

That is the f32 numerics, whose reference is another program (transformers). Under any other numerics
(core/engine/numerics.py: q8) the reference is the deployment's own plain decoding, run here in the judge's
process (`PlainDecoding`): its kernels are batch-invariant, so one forward over prompt + output gives at
every position the logits plain decoding computes, bit for bit, and the threshold is 0 mismatches with no
near-tie allowance (`exact_threshold`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from specpilot.core.engine import Engine
from specpilot.core.engine.decode import Verification
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.sampling import seeded_scores
from specpilot.core.recipe import Recipe
from specpilot.core.recipe import stock as deployment_stock

EPSILON = 0.05
MARGIN_PP = 0.005
FIRST_POSITIONS = 5


class ForcingError(ValueError):
    """A recipe token forcing cannot judge; the message says why and what to use instead."""


@dataclass
class ForcingResult:
    """Mismatch counts over all checked positions; `first` holds each request's first mismatch positions."""

    tokens: int = 0
    mismatches: int = 0
    near_ties: int = 0
    truncated: int = 0
    padded: int = 0
    first: list[list[int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.mismatches / self.tokens if self.tokens else 0.0

    @property
    def clear(self) -> int:
        return self.mismatches - self.near_ties

    def verdict(self, threshold: float) -> bool:
        """Passed: the mismatch rate (a fraction) is at most `threshold`."""
        return self.rate <= threshold

    def to_dict(self) -> dict:
        return {**asdict(self), "rate": self.rate, "clear_mismatches": self.clear}


class PlainDecoding:
    """The forcing reference of a deployment whose numerics are not f32: its own target model (the judge's, never
    a candidate's), scoring prompt + output in one forward from an empty cache."""

    exact = True

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.numerics = model.numerics

    def logits(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [len(tokens) - start, V] at positions start..end of `tokens`, float32."""
        m, n = self.model, len(tokens)
        cache = m.new_cache(1, n)
        dev = m.device
        with torch.inference_mode():
            out = m.step(torch.tensor([tokens], device=dev), cache, cache.lengths, torch.arange(n, device=dev)[None],
                         torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))[None],
                         logits_at=torch.arange(start, n, device=dev)[None])
        return out[0]


def load_reference(target_dir: str, dtype: str = "float32", device: str = "cpu", engine: Engine | None = None):
    """The stock reference: for an engine whose numerics are not f32, its own plain decoding (PlainDecoding);
    else the transformers model of the target checkpoint, float32 unless told."""
    if engine is not None and engine.numerics != "f32":
        return PlainDecoding(engine.target)
    from specpilot.core.hf import hf_model

    return hf_model(target_dir, dtype, device)


def exact_threshold(reference) -> bool:
    """Whether `reference` is the deployment's own decoding: then any mismatch fails, near-tie or not."""
    return bool(getattr(reference, "exact", False))


def _reference_logits(reference, tokens: list[int], start: int) -> torch.Tensor:
    if isinstance(reference, PlainDecoding):
        return reference.logits(tokens, start)
    dev = next(reference.parameters()).device
    with torch.inference_mode():
        return reference(input_ids=torch.tensor([tokens], device=dev), use_cache=False).logits[0, start:]


def _choices(logits: torch.Tensor, ver: Verification, request_id: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference choice and top-2 margin at each row of logits [N, V]; row i chooses position start + i."""
    if ver.sampling == "seeded":
        n = logits.shape[0]
        scores = seeded_scores(logits, ver.temperature, ver.top_p, ver.seed, torch.full((n,), request_id),
                               torch.arange(start, start + n))
    else:
        scores = logits.float()
    top = scores.topk(2, dim=-1).values
    return scores.argmax(-1), top[:, 0] - top[:, 1]


def force(reference, prompts: list[list[int]], outputs: list[list[int]], limits: list[int],
          verification: Verification | None = None, request_ids: list[int] | None = None,
          eos_token_ids: list[int] | tuple[int, ...] = ()) -> ForcingResult:
    """Compare each emitted token with the reference's choice given the emitted prefix."""
    ver = verification or Verification()
    if ver.sampling not in ("greedy", "seeded"):
        raise ForcingError(f"verify.sampling = {ver.sampling!r} has no per-token reference choice; forcing "
                           "checks greedy and seeded outputs (use seeded sampling to force sampled decoding)")
    eos = set(eos_token_ids)
    ids = request_ids if request_ids is not None else list(range(len(prompts)))
    res = ForcingResult()
    for prompt, out, limit, rid in zip(prompts, outputs, limits, ids):
        end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        checked = out[: min(end, limit)]
        wrong: list[int] = []
        if checked:
            logits = _reference_logits(reference, list(prompt) + checked[:-1], len(prompt) - 1)
            choice, margin = _choices(logits, ver, rid, len(prompt))
            bad = (choice.cpu() != torch.tensor(checked)).nonzero()[:, 0]
            wrong = bad.tolist()
            res.near_ties += int((margin.cpu()[bad] < EPSILON).sum())
        extra = len(out) - len(checked)
        missing = limit - len(checked) if (not checked or checked[-1] not in eos) and len(checked) < limit else 0
        res.padded += extra > 0
        res.truncated += missing > 0
        wrong += list(range(len(checked), len(checked) + extra + missing))
        res.tokens += len(checked) + extra + missing
        res.mismatches += len(wrong)
        res.first.append(wrong[:FIRST_POSITIONS])
    return res


def reference_verification(recipe: Recipe | None) -> Verification:
    """The reference's choice rule for a recipe: seeded recipes are re-derived seeded, all else greedy."""
    if recipe is None:
        return Verification()
    v = recipe.verify
    if v.sampling == "rejection":
        raise ForcingError("verify.sampling = 'rejection' is distribution-lossless, not token-identical, so "
                           "forcing cannot judge it; judge it with seeded sampling")
    return Verification.of(v, speculative=False)


def run_forced(engine: Engine, recipe: Recipe | None, prompts: list[list[int]], limits: list[int], reference,
               request_ids: list[int] | None = None, speculative: bool = True) -> ForcingResult:
    """Generate one request at a time (recipe None or speculative=False: our autoregressive decoding, seeded
    when the recipe is) and force the outputs."""
    ver = reference_verification(recipe)
    ids = request_ids if request_ids is not None else list(range(len(prompts)))
    spec = speculative and recipe is not None
    outputs = [engine.generate([p], [n], recipe, [rid], speculative=spec).tokens[0]
               for p, n, rid in zip(prompts, limits, ids)]
    return force(reference, prompts, outputs, limits, ver, ids, engine.target.cfg.eos_token_ids)


def stock_for(engine: Engine, recipe: Recipe | None) -> tuple[Recipe, bool]:
    """Stock (see core.recipe.stock) with the recipe's choice rule (seeded stays seeded), and whether it is
    speculative."""
    stock = deployment_stock(engine.drafter_model is not None)
    ver = reference_verification(recipe)
    if ver.sampling == "seeded":
        stock = stock.replace(verify={"sampling": "seeded", "temperature": ver.temperature, "top_p": ver.top_p,
                                      "seed": ver.seed})
    return stock, True


def compare(engine: Engine, recipe: Recipe | None, prompts: list[list[int]], limits: list[int],
            reference=None, request_ids: list[int] | None = None, reference_dtype: str = "float32",
            stock: ForcingResult | None = None) -> dict:
    """Force stock and `recipe` on the same requests; passed when rate <= stock's rate + 0.5 points.

    `stock` reuses stock's forcing result from an earlier call on the same requests with the same choice
    rule (the judge measures it once per run).
    """
    reference_verification(recipe)
    if reference is None:
        if engine.target_dir is None:
            raise ForcingError("the engine has no target checkpoint directory to load the reference from; "
                               "pass `reference`")
        reference = load_reference(engine.target_dir, reference_dtype, str(engine.device), engine)
    if stock is None:
        stock_recipe, speculative = stock_for(engine, recipe)
        stock = run_forced(engine, stock_recipe, prompts, limits, reference, request_ids, speculative)
    result = run_forced(engine, recipe, prompts, limits, reference, request_ids)
    threshold = 0.0 if exact_threshold(reference) else stock.rate + MARGIN_PP
    return {
        "recipe_name": recipe.name if recipe is not None else "ar",
        "stock_rate": stock.rate,
        "rate": result.rate,
        "threshold": threshold,
        "passed": result.verdict(threshold),
        "tokens": result.tokens,
        "mismatches": result.mismatches,
        "near_ties": result.near_ties,
        "clear_mismatches": result.clear,
        "epsilon": EPSILON,
        "reference": _describe(reference),
        "stock": stock.to_dict(),
        "result": result.to_dict(),
    }


def _describe(reference) -> str:
    """What the forcing compared against, for reports: the numerics' own decoding or transformers' dtype."""
    if isinstance(reference, PlainDecoding):
        return f"our {reference.numerics} plain decoding (exact: 0 mismatches allowed)"
    return "transformers " + str(next(reference.parameters()).dtype).removeprefix("torch.")
