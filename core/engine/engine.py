"""The engine a deployment runs: a target, an optional drafter checkpoint, and recipes to run them with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.engine.config import ModelLoadError
from core.engine.decode import GenerateResult, Verification, generate
from core.engine.drafters import Drafter, ModelDrafter, NgramDrafter, TreeSpec
from core.engine.model import Transformer
from core.engine.serve import CostTable, Policy, measure_costs, serve
from core.engine.tree import chain_paths
from core.recipe import Recipe, stock


def _vocab(path: Path) -> dict | None:
    tok = path / "tokenizer.json"
    if not tok.is_file():
        return None
    try:
        return json.loads(tok.read_text()).get("model", {}).get("vocab")
    except json.JSONDecodeError:
        raise ModelLoadError(f"{tok} is not valid JSON; re-save the tokenizer") from None


def tree_spec(recipe: Recipe) -> TreeSpec:
    """The drafting shape a recipe asks for."""
    t = recipe.tree
    if t.policy == "chain":
        return TreeSpec("static", chain_paths(t.depth))
    if t.policy == "static":
        return TreeSpec("static", [list(p) for p in t.paths])
    if t.policy == "dynamic":
        return TreeSpec("dynamic", depth=t.depth, topk=t.topk, budget=t.budget)
    from core.engine.plugins import tree_policy

    return TreeSpec("static", tree_policy(t.policy)(t))


class Engine:
    """Holds loaded models and hands out drafters per recipe; `generate` runs one batch."""

    def __init__(self, target: Transformer, drafter_model: Transformer | None = None,
                 target_dir: str | None = None, drafter_dir: str | None = None) -> None:
        self.target = target
        self.drafter_model = drafter_model
        self.target_dir = target_dir
        self.drafter_dir = drafter_dir
        self._drafters: dict[tuple, Drafter] = {}
        self._models: dict[str, Transformer] = {}
        self._tables: dict[tuple, CostTable] = {}

    @classmethod
    def load(cls, target_dir: str | Path, drafter_dir: str | Path | None = None, dtype: str = "float32",
             device: str = "cpu") -> "Engine":
        """Load the target (and drafter); a drafter whose vocabulary differs from the target's is refused."""
        target_dir = Path(target_dir)
        target = Transformer.load(str(target_dir), dtype, device)
        drafter = None
        if drafter_dir is not None:
            drafter_dir = Path(drafter_dir)
            drafter = Transformer.load(str(drafter_dir), dtype, device)
            if drafter.cfg.vocab_size != target.cfg.vocab_size:
                raise ModelLoadError(f"drafter vocabulary ({drafter.cfg.vocab_size}) does not match the target's "
                                     f"({target.cfg.vocab_size}); use a drafter trained with the target's tokenizer")
            tv, dv = _vocab(target_dir), _vocab(drafter_dir)
            if tv is not None and dv is not None and tv != dv:
                raise ModelLoadError(f"tokenizers of {target_dir} and {drafter_dir} differ; use a drafter trained "
                                     "with the target's tokenizer")
        return cls(target, drafter, str(target_dir), str(drafter_dir) if drafter_dir else None)

    def models_for(self, recipe: Recipe) -> tuple[Transformer, Transformer | None]:
        """Target and drafter model with the recipe's weight format and linear backend applied (converted
        once, cached). The linear backend is the deployment's runtime, so the drafter runs on it too: a
        small drafter's forward is mostly per-op overhead, which the fused layer removes (8x on the demo
        drafter), and the drafter only proposes, so its backend never changes the output."""
        target, drafter = self.target, self.drafter_model
        fmt, backend = recipe.weights.format, recipe.runtime.linear
        self._budget(recipe)
        if fmt == "gguf":
            from core.engine.gguf_format import gguf_transformer, source_file

            target = self._converted(fmt, lambda: gguf_transformer(self.target, source_file(self.target_dir)))
            if recipe.weights.drafter and drafter is not None:
                drafter = self._converted(fmt + ":drafter", lambda: gguf_transformer(
                    self.drafter_model, source_file(self.drafter_dir)))
        elif fmt != "native":
            from core.engine.weights import pack_transformer

            target = self._converted(fmt, lambda: pack_transformer(self.target))
            if recipe.weights.drafter and drafter is not None:
                drafter = self._converted(fmt + ":drafter", lambda: pack_transformer(self.drafter_model))
        if backend != "native":
            target = self._on_backend(fmt, target, backend)
            if drafter is not None:
                drafter = self._on_backend(f"{fmt}:drafter", drafter, backend)
        return target, drafter

    def packed_bytes(self, recipe: Recipe) -> int:
        """Private memory the recipe's weight format and linear backend would add (copies not yet built):
        packed12 keeps ~1.6 bytes per weight; onednn 4 (float32); skinny and fused 8 (skinny's panels plus
        oneDNN's copy for wide steps). gguf and native read memory-mapped weights: nothing."""
        fmt, backend = recipe.weights.format, recipe.runtime.linear
        target = sum(m.numel() for m in self.target.matrices())
        drafter = sum(m.numel() for m in self.drafter_model.matrices()) if self.drafter_model is not None else 0
        needed = 0.0
        if fmt == "packed12" and fmt not in self._models:
            needed += 1.6 * (target + (drafter if recipe.weights.drafter else 0))
        if backend != "native" and f"{fmt}+{backend}" not in self._models:
            needed += {"onednn": 4.0, "skinny": 8.0, "fused": 8.0}.get(backend, 0.0) * (target + drafter)
        return int(needed)

    def _budget(self, recipe: Recipe) -> None:
        """Refuse, before building them, packed copies that would not fit in the memory available now."""
        needed = self.packed_bytes(recipe)
        if needed:
            from core.engine.memory import require

            require(needed, f"weights.format = {recipe.weights.format!r} with runtime.linear = "
                            f"{recipe.runtime.linear!r}",
                    "use runtime.linear = 'native' (memory-mapped, shared) or a smaller model")

    def _on_backend(self, key: str, model: Transformer, backend: str) -> Transformer:
        """`model` (cached under `key`) with its projections on `backend`; fused builds on the skinny copy,
        sharing its packed weights."""
        from core.engine.linear import linear_transformer

        def skinny() -> Transformer:
            return self._converted(f"{key}+skinny", lambda: linear_transformer(model, "skinny"))

        return self._converted(f"{key}+{backend}", lambda: linear_transformer(model, backend, skinny))

    def _converted(self, key: str, build) -> Transformer:
        if key not in self._models:
            self._models[key] = build()
        return self._models[key]

    def drafter_for(self, recipe: Recipe) -> Drafter:
        target, drafter_model = self.models_for(recipe)
        d = recipe.draft
        key = (d.method, d.exit_layer, d.ngram_max, recipe.weights.format, recipe.weights.drafter,
               recipe.runtime.linear)
        if key in self._drafters:
            return self._drafters[key]
        if d.method == "ngram":
            drafter: Drafter = NgramDrafter(d.ngram_max)
        elif d.method == "early_exit":
            layers = d.exit_layer or target.cfg.num_layers // 2
            if layers >= target.cfg.num_layers:
                raise ModelLoadError(f"draft.exit_layer = {layers} must be below the target's "
                                     f"{target.cfg.num_layers} layers")
            drafter = ModelDrafter(target.truncated(layers))
        else:
            if drafter_model is None:
                raise ModelLoadError("draft.method = 'model' needs a drafter checkpoint; pass --drafter DIR or "
                                     "use draft.method 'ngram' or 'early_exit'")
            drafter = ModelDrafter(drafter_model)
        self._drafters[key] = drafter
        return drafter

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], recipe: Recipe | None = None,
                 request_ids: list[int] | None = None, speculative: bool = True) -> GenerateResult:
        """Run `recipe` (default stock) on a batch; speculative=False is plain autoregressive decoding."""
        recipe = recipe or stock(self.drafter_model is not None)
        target, _ = self.models_for(recipe)
        v = recipe.verify
        ver = Verification(v.sampling if speculative or v.sampling == "seeded" else "greedy",
                           v.temperature, v.top_p, v.seed)
        if not speculative:
            return generate(target, None, prompts, max_new_tokens, None, ver, request_ids)
        return generate(target, self.drafter_for(recipe), prompts, max_new_tokens, tree_spec(recipe), ver,
                        request_ids)

    def cost_table(self, recipe: Recipe, batch_sizes: list[int]) -> CostTable:
        """The batching policies' step prices for this recipe's target (weights, linear backend) and drafter
        (none for n-gram lookup), measured once per batch size and cached."""
        target, _ = self.models_for(recipe)
        drafter = self.drafter_for(recipe)
        d = recipe.draft
        key = (recipe.weights.format, recipe.weights.drafter, recipe.runtime.linear, d.method, d.exit_layer)
        table = self._tables.setdefault(key, CostTable())
        missing = sorted(set(batch_sizes) - {r for r, _ in table.verify})
        if missing:
            model = drafter.model if isinstance(drafter, ModelDrafter) else None
            measured = measure_costs(target, model, missing)
            table.verify.update(measured.verify)
            table.draft.update(measured.draft)
        return table

    def serve(self, prompts: list[list[int]], limits: list[int], recipe: Recipe | None, max_batch: int,
              table: CostTable | None = None, request_ids: list[int] | None = None,
              speculative: bool = True) -> GenerateResult:
        """Continuous batching of many requests (recipe None = batched autoregressive decoding; speculative
        False = the same on the recipe's target, its weight format and linear backend). Batching policies
        price steps with `table`, by default the recipe's own measured cost table."""
        if recipe is None or not speculative:
            target = self.target if recipe is None else self.models_for(recipe)[0]
            return serve(target, None, prompts, limits, None, max_batch=max_batch, request_ids=request_ids)
        target, _ = self.models_for(recipe)
        b, v = recipe.batching, recipe.verify
        if table is None and b.policy != "fixed":
            table = self.cost_table(recipe, [max_batch])
        policy = Policy(b.policy, tree_spec(recipe), table, b.node_budget, b.token_cap, target.ragged)
        return serve(target, self.drafter_for(recipe), prompts, limits, tree_spec(recipe), policy, max_batch,
                     Verification(v.sampling, v.temperature, v.top_p, v.seed), request_ids)

    @property
    def device(self) -> torch.device:
        return self.target.device
