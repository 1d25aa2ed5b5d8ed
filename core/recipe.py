"""The recipe: which mechanisms a deployment runs with, typed, validated, and stored as TOML.

A recipe is what agents change (as a unified diff of its TOML text) and what the judge compares, so its
TOML rendering is canonical: the same recipe always renders to the same text.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.core.mechanisms import (PLUGIN_PREFIX, UnknownMechanism, builtin_names, check_builtin_name,  # noqa: F401
                             find, recipe_mechanisms, specs, violation)

LEGACY_FALSE = {"runtime": ("compile", "cuda_graphs")}  # keys of older recipes, never implemented when true


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the field and the allowed values."""


@dataclass
class DraftSection:
    method: str = "model"
    exit_layer: int = 0
    ngram_max: int = 3
    length: str = "fixed"

    def exit_layers(self, target_layers: int) -> int:
        """The early exit's depth: exit_layer, or half the target's layers when it is 0 (the default)."""
        return self.exit_layer or target_layers // 2

    def drafter_key(self, target_layers: int) -> str:
        """What the cost model keys a drafter by: 'model', 'ngram', 'early_exit:E' (E resolved), or a
        plugin drafter's own name."""
        if self.method == "early_exit":
            return f"early_exit:{self.exit_layers(target_layers)}"
        return self.method


@dataclass
class TreeSection:
    policy: str = "chain"
    depth: int = 4
    budget: int = 16
    topk: int = 4
    paths: list[list[int]] = field(default_factory=list)


@dataclass
class VerifySection:
    sampling: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class WeightsSection:
    format: str = "native"
    drafter: bool = False
    drafter_format: str = "same"


@dataclass
class RuntimeSection:
    linear: str = "native"


@dataclass
class BatchingSection:
    policy: str = "fixed"
    node_budget: int = 0
    token_cap: int = 0


SECTIONS: dict[str, type] = {
    "draft": DraftSection,
    "tree": TreeSection,
    "verify": VerifySection,
    "weights": WeightsSection,
    "runtime": RuntimeSection,
    "batching": BatchingSection,
}


@dataclass
class Recipe:
    """A complete speculative-decoding configuration; `stock` is the deployment's drafter in a chain."""

    name: str = "custom"
    draft: DraftSection = field(default_factory=DraftSection)
    tree: TreeSection = field(default_factory=TreeSection)
    verify: VerifySection = field(default_factory=VerifySection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    batching: BatchingSection = field(default_factory=BatchingSection)

    def validate(self) -> "Recipe":
        """Raise RecipeError naming the first bad field; return self so calls chain."""
        for kind, value in recipe_mechanisms(self):
            try:
                check_builtin_name(kind, value)
            except UnknownMechanism as exc:
                raise RecipeError(str(exc)) from None
        _positive("tree.depth", self.tree.depth, 1, 64)
        _positive("tree.budget", self.tree.budget, 1, 256)
        _positive("tree.topk", self.tree.topk, 1, 64)
        _positive("draft.ngram_max", self.draft.ngram_max, 1, 16)
        _positive("draft.exit_layer", self.draft.exit_layer, 0, 1024)
        _positive("batching.node_budget", self.batching.node_budget, 0, 4096)
        _positive("batching.token_cap", self.batching.token_cap, 0, 65536)
        if not 0.0 < self.verify.temperature <= 100.0:
            raise RecipeError(f"verify.temperature must be in (0, 100], got {self.verify.temperature}")
        if not 0.0 < self.verify.top_p <= 1.0:
            raise RecipeError(f"verify.top_p must be in (0, 1], got {self.verify.top_p}")
        for i, path in enumerate(self.tree.paths):
            if not path or not all(isinstance(r, int) and r >= 0 for r in path):
                raise RecipeError(f"tree.paths[{i}] must be a non-empty list of ranks >= 0, got {path!r}")
        message = violation(self)  # what each mechanism's registration needs of the other fields
        if message is not None:
            raise RecipeError(message)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """Canonical TOML text (sections and keys in declaration order)."""
        lines = [f"name = {_toml_value(self.name)}"]
        for section in SECTIONS:
            lines.append("")
            lines.append(f"[{section}]")
            for key, value in dataclasses.asdict(getattr(self, section)).items():
                lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    def replace(self, **changes: dict[str, Any]) -> "Recipe":
        """A copy with some fields changed: replace(tree={"depth": 6}, name="deeper")."""
        data = self.to_dict()
        for key, value in changes.items():
            if isinstance(value, dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return Recipe.from_dict(data)

    def switched(self, kind: str, name: str) -> "Recipe":
        """A copy running built-in `name` of `kind`, with the other fields its registration says go with it
        (what its constraints need, the drafter taking it too): how the cost model, the agents and the presets
        switch a mechanism without knowing it by name."""
        mech = find(kind, name)
        if mech is None:
            raise RecipeError(f"{kind} {name!r} is not a registered built-in; allowed: {', '.join(builtin_names(kind))}")
        return self.replace(**mech.settings())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "recipe") -> "Recipe":
        unknown = sorted(set(data) - {"name", *SECTIONS})
        if unknown:
            raise RecipeError(f"{source}: unknown field {unknown[0]!r}; allowed: name, {', '.join(SECTIONS)}")
        kwargs: dict[str, Any] = {}
        if "name" in data:
            if not isinstance(data["name"], str):
                raise RecipeError(f"{source}: name must be a string")
            kwargs["name"] = data["name"]
        for section, klass in SECTIONS.items():
            raw = data.get(section, {})
            if not isinstance(raw, dict):
                raise RecipeError(f"{source}: [{section}] must be a table")
            fields = {f.name: f for f in dataclasses.fields(klass)}
            raw = _drop_legacy(section, raw, source)
            for key, value in raw.items():
                if key not in fields:
                    raise RecipeError(f"{source}: unknown field {section}.{key}; allowed: {', '.join(fields)}")
                default = getattr(klass(), key)
                if not _same_type(default, value):
                    raise RecipeError(f"{source}: {section}.{key} must be {type(default).__name__}, "
                                      f"got {value!r}")
            kwargs[section] = klass(**{k: (float(v) if isinstance(getattr(klass(), k), float) else v)
                                       for k, v in raw.items()})
        return cls(**kwargs).validate()

    @classmethod
    def from_toml(cls, text: str, source: str = "recipe") -> "Recipe":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RecipeError(f"{source}: not valid TOML ({exc}); fix the file or re-export it") from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist; pass a TOML file or a built-in name")
        return cls.from_toml(path.read_text(), source=str(path))


def _drop_legacy(section: str, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Recipes stored before [runtime] had `linear` carried compile/cuda_graphs = false; they still load.
    Set to true they are refused: this engine never implemented them."""
    legacy = LEGACY_FALSE.get(section, ())
    for key in legacy:
        if raw.get(key) is True:
            raise RecipeError(f"{source}: {section}.{key} = true is not implemented by this engine; remove it "
                              f"(the [runtime] option it has is linear = {' | '.join(builtin_names('linear_backend'))})")
    return {k: v for k, v in raw.items() if k not in legacy or v is not False}


def _positive(name: str, value: int, low: int, high: int) -> None:
    if not (isinstance(value, int) and low <= value <= high):
        raise RecipeError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _same_type(default: Any, value: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type(default))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")


def presets() -> dict[str, Recipe]:
    """Every built-in recipe by name: `stock` (the defaults: the deployment's drafter in a chain of 4), then
    the presets each built-in mechanism's registration contributes, in registration order."""
    out = {"stock": Recipe(name="stock")}
    for mech in specs():
        for preset in mech.presets:
            out[preset.name] = out[preset.base].switched(mech.kind, mech.name).replace(name=preset.name,
                                                                                       **preset.changes)
    return out


def builtin(name: str) -> Recipe:
    """A built-in preset (see `presets`)."""
    known = presets()
    if name not in known:
        raise RecipeError(f"unknown built-in recipe {name!r}; built-ins: {', '.join(known)}, or a .toml path")
    return known[name].validate()


def stock(has_drafter: bool = True) -> Recipe:
    """What a user gets without SpecPilot: the deployment's drafter model in a chain of 4; a deployment with
    no drafter model (`--drafter none`) gets prompt lookup (3-gram, chain of 4), as serving engines offer."""
    if has_drafter:
        return builtin("stock")
    return Recipe(name="stock", draft=DraftSection(method="ngram", ngram_max=3),
                  tree=TreeSection(policy="chain", depth=4)).validate()


def resolve(spec: str, has_drafter: bool = True) -> Recipe:
    """A built-in name or a TOML path (`stock` as the deployment has it: see `stock`)."""
    if spec.endswith(".toml") or "/" in spec:
        return Recipe.load(spec)
    return stock(has_drafter) if spec == "stock" else builtin(spec)


def changed_fields(recipe: Recipe, base: Recipe | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sections and fields `recipe` sets differently from `base` (a recipe or its dict): what a
    candidate changed, what memory stores as a mechanism, what a rejection names."""
    old = base.to_dict() if isinstance(base, Recipe) else base
    out: dict[str, dict[str, Any]] = {}
    for section, fields in recipe.to_dict().items():
        if isinstance(fields, dict):
            changed = {k: v for k, v in fields.items() if (old.get(section) or {}).get(k) != v}
            if changed:
                out[section] = changed
    return out


def combine(incumbent: Recipe, winners: list[Recipe]) -> Recipe | None:
    """Each winner's changed fields (relative to the incumbent) applied on top of each other, best first: a
    field the first winner changed is not overridden by a later one. None when the result is invalid."""
    base = incumbent.to_dict()
    merged = json.loads(json.dumps(base))
    for w in winners:
        for section, fields in changed_fields(w, base).items():
            for key, value in fields.items():
                if merged[section][key] == base[section][key]:
                    merged[section][key] = value
    try:
        return Recipe.from_dict({**merged, "name": "combined"})
    except ValueError:
        return None
