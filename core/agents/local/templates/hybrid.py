"""Two-level drafting, written by the hybrid-drafter agent and fitted on the tuning requests' replay:
draft by n-gram lookup (max n = the recipe's draft.ngram_max, to the tree's depth) when the context has a
match, and with the drafter model (to depth MODEL_DEPTH) when it has none. The model's cache catches up
on the tokens committed meanwhile at its next draft, so a lookup step costs no model forward."""

from typing import Any

from specpilot.core.engine.drafters import Drafter, DraftMode, ModelDrafter, NgramDrafter, TreeSpec
from specpilot.core.engine.tree import DraftTree
from specpilot.core.mechanisms import register

MODEL_DEPTH = 3


class Hybrid(Drafter):
    """N-gram lookup where every active row has a match, else the drafter model for the whole step."""

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter) -> None:
        self.ngram, self.model = ngram, model

    def reset(self, prompts: list[list[int]], max_len: int) -> None:
        self.ngram.reset(prompts, max_len)
        self.model.reset(prompts, max_len)

    def open(self, max_batch: int, max_len: int) -> None:
        self.ngram.open(max_batch, max_len)
        self.model.open(max_batch, max_len)

    @property
    def kv_model(self) -> Any:
        return self.model.kv_model

    @property
    def cache(self) -> Any:
        """The model's KV cache (what a server reports as resident beside the target's)."""
        return self.model.cache

    def reuse_prefixes(self, cache: Any) -> None:
        self.model.reuse_prefixes(cache)

    def admit(self, prompt: list[int]) -> int:
        self.ngram.admit(prompt)
        return self.model.admit(prompt)

    def move(self, src: int, dst: int) -> None:
        self.ngram.move(src, dst)
        self.model.move(src, dst)

    def drop_last(self) -> None:
        self.ngram.drop_last()
        self.model.drop_last()

    def draft(self, spec: TreeSpec, mode: DraftMode, active: list[bool]) -> list[DraftTree]:
        trees = self.ngram.draft(spec, mode, active)
        if all(len(t) > 1 for t, a in zip(trees, active) if a):
            return trees
        self.model.catch_up(active=active)  # the model is fed what lookup steps committed only when it drafts
        return self.model.draft(spec.shortened(MODEL_DEPTH), mode, active)

    def commit(self, rows: list[int], paths: list[list[int]], tokens: list[list[int]]) -> None:
        self.ngram.commit(rows, paths, tokens)
        self.model.commit(rows, paths, tokens)


def build(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Hybrid:
    """The engine's drafter for a recipe naming this plugin; it needs the deployment's drafter model."""
    if drafter_model is None:
        raise ValueError("the hybrid drafter needs a drafter checkpoint (--drafter DIR)")
    return Hybrid(NgramDrafter(recipe.draft.ngram_max), ModelDrafter(drafter_model))


register("drafter", "hybrid", build)
