"""The engine a deployment runs: a target, an optional drafter checkpoint, and recipes to run them with."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specpilot.core.engine import cost_store
from specpilot.core.engine import numerics as numerics_
from specpilot.core.engine.batching import CostTable, Policy, measure_catch_up, measure_costs
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.decode import GenerateResult, Verification
from specpilot.core.engine.drafters import Drafter, ModelDrafter, TreeSpec
from specpilot.core.engine.model import Transformer
from specpilot.core.engine.scheduler import Scheduler, check_fits, drive, generate
from specpilot.core.mechanisms import check_recipe, find, lookup
from specpilot.core.recipe import Recipe, stock


def _vocab(path: Path) -> dict | None:
    tok = path / "tokenizer.json"
    if not tok.is_file():
        return None
    try:
        return json.loads(tok.read_text()).get("model", {}).get("vocab")
    except json.JSONDecodeError:
        raise ModelLoadError(f"{tok} is not valid JSON; re-save the tokenizer") from None


def tree_spec(recipe: Recipe) -> TreeSpec:
    """The drafting shape a recipe asks for (its registered tree policy's)."""
    shape = lookup("tree_policy", recipe.tree.policy)(recipe.tree)
    return shape if isinstance(shape, TreeSpec) else TreeSpec("static", [list(p) for p in shape])


@dataclass(frozen=True)
class ModelKey:
    """Which converted copy of a model the engine caches: whose weights (`target` or `drafter`), in which weight
    format, on which linear backend (`skinny` also as the copy `fused` builds on), in which drafter format."""

    role: str
    format: str = "native"
    backend: str = "native"
    drafter_format: str = "same"


@dataclass(frozen=True)
class DrafterKey:
    """Which drafter a recipe drafts with: its method and what the method reads (exit layer, n-gram size), and
    the drafter model's copy (weight format, whether the format applies to it, drafter format, backend)."""

    method: str
    exit_layer: int | None
    ngram_max: int
    format: str
    drafter: bool
    drafter_format: str
    linear: str

    @classmethod
    def of(cls, recipe: Recipe) -> "DrafterKey":
        d, w = recipe.draft, recipe.weights
        return cls(d.method, d.exit_layer, d.ngram_max, w.format, w.drafter, w.drafter_format, recipe.runtime.linear)


@dataclass(frozen=True)
class CostKey:
    """Which steps a cost table prices: the target's copy (weight format, linear backend) and the drafter's
    (whether the format applies to it, its drafter format, method and exit layer). Stored tables are found by
    its fields in this order (core/engine/cost_store.py)."""

    format: str
    drafter: bool
    drafter_format: str
    linear: str
    method: str
    exit_layer: int | None

    @classmethod
    def of(cls, recipe: Recipe) -> "CostKey":
        d, w = recipe.draft, recipe.weights
        return cls(w.format, w.drafter, w.drafter_format, recipe.runtime.linear, d.method, d.exit_layer)


class Engine:
    """Holds loaded models and hands out drafters per recipe; `generate` runs one batch."""

    def __init__(self, target: Transformer, drafter_model: Transformer | None = None,
                 target_dir: str | None = None, drafter_dir: str | None = None) -> None:
        self.target = target
        self.numerics = target.numerics
        self.drafter_model = drafter_model
        self.target_dir = target_dir
        self.drafter_dir = drafter_dir
        self._drafters: dict[DrafterKey, Drafter] = {}
        self._models: dict[ModelKey, Transformer] = {}
        self._tables: dict[CostKey, CostTable] = {}
        for model, where in ((target, target_dir), (drafter_model, drafter_dir)):
            if model is not None and where is not None:  # the checkpoint a model came from (and its GGUF file,
                model.checkpoint = str(where)  # gguf_checkpoint.source): drafter_format 'blocks8' reads it

    @classmethod
    def load(cls, target_dir: str | Path, drafter_dir: str | Path | None = None, dtype: str = "float32",
             device: str = "cpu", numerics: str = "f32") -> "Engine":
        """Load the target in the deployment's `numerics` (core/engine/numerics.py) and the drafter; a drafter
        whose vocabulary differs from the target's is refused."""
        target_dir = Path(target_dir)
        source = numerics_.require_gguf(numerics, str(target_dir))
        target = Transformer.load(str(target_dir), dtype, device)
        if source is not None:
            target = numerics_.q8_transformer(target, source)
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
        return self._models_for(recipe, True)

    def target_for(self, recipe: Recipe) -> Transformer:
        """The recipe's target alone (models_for's first): plain decoding on a recipe's target must not pay
        for the drafter's copies (a 4-bit drafter is built by reading its float32 weights)."""
        return self._models_for(recipe, False)[0]

    def _models_for(self, recipe: Recipe, with_drafter: bool) -> tuple[Transformer, Transformer | None]:
        check_recipe(recipe)
        target, drafter = self.target, self.drafter_model if with_drafter else None
        fmt, backend = recipe.weights.format, recipe.runtime.linear
        numerics_.check_recipe(self.numerics, fmt, backend)
        self._budget(recipe)
        keys = self._keys(recipe)
        if keys["target"].format != "native":
            convert = lookup("weight_format", fmt)
            target = self._converted(keys["target"], lambda: convert(self.target, self.target_dir, recipe))
        if drafter is not None and keys["drafter"].format != "native":
            convert = lookup("weight_format", fmt)
            drafter = self._converted(keys["drafter"], lambda: convert(self.drafter_model, self.drafter_dir, recipe))
        if backend != "native":
            target = self._on_backend(keys["target"], target, backend)
            if drafter is not None:
                drafter = self._on_backend(keys["drafter"], drafter, backend)
        form = recipe.weights.drafter_format
        if form != "same" and drafter is not None:
            exact = drafter
            drafter = self._converted(keys["drafter_format"], lambda: lookup("drafter_format", form)(exact))
        return target, drafter

    def _keys(self, recipe: Recipe) -> dict[str, ModelKey]:
        """The cache keys of the copies a recipe runs on: the target and the drafter model in the recipe's weight
        format (as loaded where it does not apply: a q8 target computes on its own blocks, and a drafter is
        converted only with weights.drafter), on its linear backend, and the drafter in its drafter format."""
        w, backend = recipe.weights, recipe.runtime.linear
        target = ModelKey("target", w.format if self.numerics == "f32" else "native")
        drafter = ModelKey("drafter", w.format if w.drafter else "native")
        return {"target": target, "drafter": drafter,
                "target_backend": replace(target, backend=backend),
                "drafter_format": replace(drafter, backend=backend, drafter_format=w.drafter_format)}

    def packed_bytes(self, recipe: Recipe) -> int:
        """Private memory the copies the recipe's mechanisms would build add (those not yet built): each
        mechanism's registered bytes (core.mechanisms.MechanismSpec.memory, core/engine/builtins.py) over the
        weights its copy converts. Formats that read memory-mapped weights (native, gguf) register none."""
        needed = 0.0
        for kind, value, built, weights in self._copies(recipe):
            mech = find(kind, value)
            if mech is not None and not built:
                needed += mech.bytes_for(weights)
        return int(needed)

    def _copies(self, recipe: Recipe) -> list[tuple[str, str, bool, int]]:
        """(kind, value, whether it is built, weights it converts) of each copy the recipe's mechanisms build:
        the weight format converts the target (and the drafter model with weights.drafter), the linear backend
        both, the drafter format the drafter model, and a drafter method builds from the drafter model."""
        target = sum(m.numel() for m in self.target.matrices())
        drafter = sum(m.numel() for m in self.drafter_model.matrices()) if self.drafter_model is not None else 0
        w, fmt, backend = recipe.weights, recipe.weights.format, recipe.runtime.linear
        keys = self._keys(recipe)
        return [("weight_format", fmt, keys["target"] in self._models, target + (drafter if w.drafter else 0)),
                ("linear_backend", backend, keys["target_backend"] in self._models, target + drafter),
                ("drafter_format", w.drafter_format, keys["drafter_format"] in self._models, drafter),
                ("drafter", recipe.draft.method, DrafterKey.of(recipe) in self._drafters, drafter)]

    def _budget(self, recipe: Recipe) -> None:
        """Refuse, before building them, packed copies that would not fit in the memory available now."""
        needed = self.packed_bytes(recipe)
        if needed:
            from specpilot.core.engine.ram_budget import require

            require(needed, f"weights.format = {recipe.weights.format!r} (drafter_format = "
                            f"{recipe.weights.drafter_format!r}) with runtime.linear = "
                            f"{recipe.runtime.linear!r}",
                    "use runtime.linear = 'native' (memory-mapped, shared) or a smaller model")

    def _on_backend(self, key: ModelKey, model: Transformer, backend: str) -> Transformer:
        """`model` (cached under `key`) with its projections on `backend`; fused builds on the skinny copy,
        sharing its packed weights."""
        def skinny() -> Transformer:
            build = lookup("linear_backend", "skinny")
            return self._converted(replace(key, backend="skinny"), lambda: build(model, None))

        build = lookup("linear_backend", backend)
        return self._converted(replace(key, backend=backend), lambda: build(model, skinny))

    def _converted(self, key: ModelKey, build) -> Transformer:
        if key not in self._models:
            self._models[key] = build()
        return self._models[key]

    def drafter_for(self, recipe: Recipe) -> Drafter:
        target, drafter_model = self.models_for(recipe)
        key = DrafterKey.of(recipe)
        if key in self._drafters:
            return self._drafters[key]
        drafter: Drafter = lookup("drafter", recipe.draft.method)(self, recipe, target, drafter_model)
        self._drafters[key] = drafter
        return drafter

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], recipe: Recipe | None = None,
                 request_ids: list[int] | None = None, speculative: bool = True) -> GenerateResult:
        """Run `recipe` (default stock) on a batch; speculative=False is plain autoregressive decoding."""
        recipe = recipe or stock(self.drafter_model is not None)
        target = self.target_for(recipe)
        ver = Verification.of(recipe.verify, speculative)
        if not speculative:
            return generate(target, None, prompts, max_new_tokens, None, ver, request_ids)
        length = None if recipe.draft.length == "fixed" else lookup("draft_length", recipe.draft.length)
        return generate(target, self.drafter_for(recipe), prompts, max_new_tokens, tree_spec(recipe), ver,
                        request_ids, draft_length=length)

    def cost_table(self, recipe: Recipe, batch_sizes: list[int], stored: bool = False,
                   remeasure: bool = False) -> CostTable:
        """The batching policies' step prices for this recipe's target (weights, linear backend) and drafter
        (none for n-gram lookup), measured once per batch size and cached in this engine. `stored`: also kept
        on disk per deployment and machine (core/engine/cost_store.py), so the next process reads them instead
        of measuring; `remeasure` measures again regardless. `source` says which happened. A kept table from
        before the drafter's catch-up was priced (no `catch_up`) gets that price measured alone, and is kept
        again with it."""
        target, _ = self.models_for(recipe)
        drafter = self.drafter_for(recipe)
        key = CostKey.of(recipe)
        identity = self._cost_identity(key, target)
        if remeasure:
            self._tables.pop(key, None)
        if key not in self._tables:
            self._tables[key] = (cost_store.load(identity) if stored and not remeasure else None) or CostTable()
        table = self._tables[key]
        missing = sorted(set(batch_sizes) - {r for r, _ in table.verify})
        model = drafter.model if isinstance(drafter, ModelDrafter) else None
        measured_now = False
        if missing:
            measured = measure_costs(target, model, missing)
            table.verify.update(measured.verify)
            table.draft.update(measured.draft)
            if measured.catch_up is not None:
                table.catch_up = measured.catch_up
            measured_now = True
        if model is not None and table.catch_up is None:
            table.catch_up = measure_catch_up(model)
            measured_now = True
        if measured_now:
            table.source = "measured now"
            if stored:
                table.source = f"measured now, kept in {cost_store.save(identity, table)}"
        return table

    def _cost_identity(self, key: CostKey, target: Transformer) -> dict:
        """Everything a step's cost depends on (see core/engine/cost_store.py)."""
        files = [str(Path(p).resolve()) if p else None for p in (self.target_dir, self.drafter_dir)]
        return {"target": files[0], "drafter": files[1], "numerics": self.numerics, "dtype": str(target.dtype),
                "device": str(target.device), "recipe": list(astuple(key)), "cpu": cost_store.device_name(str(target.device)),
                "threads": torch.get_num_threads(), "torch": torch.__version__, "code": cost_store.step_code()}

    def serve(self, prompts: list[list[int]], limits: list[int], recipe: Recipe | None, max_batch: int,
              table: CostTable | None = None, request_ids: list[int] | None = None,
              speculative: bool = True) -> GenerateResult:
        """Continuous batching of a fixed list of requests through `scheduler` (see there for the arguments)."""
        target = self.target if recipe is None else self.target_for(recipe)
        check_fits(target, prompts, limits)
        sched = self.scheduler(recipe, max_batch, max(len(p) + n for p, n in zip(prompts, limits)), table,
                               speculative)
        return drive(sched, prompts, limits, request_ids)

    def scheduler(self, recipe: Recipe | None, max_batch: int, max_len: int | None = None,
                  table: CostTable | None = None, speculative: bool = True, **serving: Any) -> Scheduler:
        """The online continuous-batching scheduler for `recipe` (None = batched autoregressive decoding;
        speculative False = the same on the recipe's target, its weight format and linear backend): requests
        of up to `max_len` tokens (prompt and new ones; default the model's context) join and leave between
        steps. Batching policies price steps with `table`, by default the recipe's own measured cost table.
        `serving` passes the token budget, prefix cache and KV budget options on to the Scheduler."""
        if recipe is None or not speculative:
            target = self.target if recipe is None else self.target_for(recipe)
            return Scheduler(target, None, None, max_batch=max_batch, max_len=max_len, **serving)
        target, _ = self.models_for(recipe)
        b = recipe.batching
        length = None if recipe.draft.length == "fixed" else lookup("draft_length", recipe.draft.length)
        if length is not None and b.policy != "fixed":
            from specpilot.core.engine.decode import GenerationError

            raise GenerationError(f"draft.length = {recipe.draft.length!r} and batching.policy = {b.policy!r} both "
                                  "set each row's depth; keep one (draft.length = 'fixed' or batching.policy = 'fixed')")
        if table is None and b.policy != "fixed":
            table = self.cost_table(recipe, [max_batch])
        policy = Policy(b.policy, tree_spec(recipe), table, b.node_budget, b.token_cap, target.ragged)
        return Scheduler(target, self.drafter_for(recipe), tree_spec(recipe), policy, max_batch, max_len,
                         Verification.of(recipe.verify), length, **serving)

    @property
    def device(self) -> torch.device:
        return self.target.device
