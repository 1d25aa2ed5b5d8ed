"""The names the cost model keys its measurements by, as values: an agent compares and builds these, and
reads the cost model's own strings into them once, where they come in."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specpilot.core.recipe import Recipe

EARLY_EXIT = "early_exit"


@dataclass(frozen=True)
class DrafterKey:
    """A drafter CostTools replays and prices: a method ('model', 'ngram', a plugin's), or an early exit of
    the target after `exit_layer` layers."""

    method: str
    exit_layer: int = 0

    @classmethod
    def parse(cls, name: str) -> DrafterKey:
        """The key CostTools.drafters names ('model', 'ngram', 'early_exit:E')."""
        if name.startswith(EARLY_EXIT + ":"):
            return cls(EARLY_EXIT, int(name.removeprefix(EARLY_EXIT + ":")))
        return cls(name)

    @classmethod
    def of(cls, recipe: Recipe, target_layers: int) -> DrafterKey:
        """The drafter `recipe` drafts with, its early exit resolved on a target of `target_layers` layers."""
        draft = recipe.draft
        if draft.method == EARLY_EXIT:
            return cls(EARLY_EXIT, draft.exit_layers(target_layers))
        return cls(draft.method)

    def __str__(self) -> str:
        return f"{EARLY_EXIT}:{self.exit_layer}" if self.method == EARLY_EXIT else self.method

    def drafting(self, recipe: Recipe) -> Recipe:
        """`recipe` drafting with this drafter."""
        return recipe.replace(draft={"method": self.method, "exit_layer": self.exit_layer})


@dataclass(frozen=True)
class CurveKey:
    """Which of the profile's measured drafter forward curves: the target's variant (a linear backend, or
    'gguf') and the curve key of the drafter model's own format ('same' when it has none)."""

    variant: str
    drafter_format: str = "same"

    @classmethod
    def parse(cls, name: str) -> CurveKey:
        """The profile's key for it ('native', 'gguf+q4')."""
        variant, _, form = name.partition("+")
        return cls(variant, form or "same")

    @classmethod
    def of(cls, recipe: Recipe) -> CurveKey:
        """The curve that prices `recipe`'s drafter model (what profile.drafter_variant_key names)."""
        from specpilot.core.costmodel.profile import drafter_variant_key

        return cls.parse(drafter_variant_key(recipe))

    def __str__(self) -> str:
        return self.variant if self.drafter_format == "same" else f"{self.variant}+{self.drafter_format}"

    def in_format(self, drafter_format: str) -> CurveKey:
        """The same target variant with the drafter in `drafter_format`."""
        return replace(self, drafter_format=drafter_format)


def drafter_curves(measured: dict[str, Any]) -> dict[CurveKey, dict[int, float]]:
    """The drafter model's measured forward curve (rows: ms) per CurveKey, from the profile's
    drafter_backend_curves; a variant without a drafter-model curve is left out."""
    curves = {CurveKey.parse(name): (kinds or {}).get("model") for name, kinds in measured.items()}
    return {key: curve for key, curve in curves.items() if curve}
