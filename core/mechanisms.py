"""One registry for every mechanism a recipe names, keyed by (kind, name), each registered once with
every fact the rest of the system reads about it (its MechanismSpec).

Built-ins (core/engine/builtins.py) and workspace plugins register through the same `register` call, so
the engine looks every mechanism up here instead of branching on strings, and an unknown name is an error
that lists the known ones, never a silent fallback. A recipe names a built-in bare (`"greedy"`) and a
plugin with the `plugin:` prefix (`"plugin:adaptive"`); a plugin can never shadow a built-in. What the
recipe validates, what the engine budgets in memory, which measured curve the cost model prices with, what
the agents are told and which presets exist are all read from the specs, so a new weight format is one
registration.

This module imports nothing heavy (no torch), so a recipe can be validated anywhere, including the loop's
process, which never imports candidate code: there a plugin name is checked against the workspace's plugin
files read as text (`declared`), never executed.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

PLUGIN_PREFIX = "plugin:"
PLUGIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

Constraint = Callable[[Any], "str | None"]  # recipe -> the error it breaks, or None


@dataclass(frozen=True)
class Kind:
    """A mechanism kind: the recipe field that names it, its interface, one short example plugin, and the
    built-in a plugin of this kind is priced as where the plugin is never imported (`stand_in`).
    `drafter_field` is the recipe flag that applies a mechanism of this kind to the drafter model too."""

    name: str
    field: str
    interface: str
    example: str
    stand_in: str
    drafter_field: str = ""


@dataclass(frozen=True)
class Needs:
    """A constraint that says how to meet it: selecting the mechanism needs `field` (dotted) = `value`.
    `why` completes the error "<its field> = '<name>' <why>; set <field> = <value>". The cost model and the
    agents apply it when they switch a recipe to the mechanism, so they need not know it by name."""

    field: str
    value: Any
    why: str


@dataclass(frozen=True)
class Preset:
    """A built-in recipe a mechanism contributes: the preset `base` (contributed before it) switched to the
    mechanism, with `changes` ({section: {key: value}}) on top."""

    name: str
    base: str = "stock"
    changes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class MechanismSpec:
    """A mechanism and every fact the rest of the system needs about it, in one registration.

    memory: private bytes a copy built for it adds, per weight of the models it converts (a number), or as
      a function of their weight count (a per-model size, or one that depends on the machine); the engine
      budgets it before building the copy.
    curve: the cost model's key for the forward curve it is priced on: a linear backend's own, a weight
      format that runs its own kernel (on no linear backend), a drafter format's suffix ("gguf+q4"). None:
      priced on the curve of the mechanisms around it.
    constraints: what it needs of the recipe's other fields (Needs, or a function returning the error).
    stand_in: the built-in the agents' cost model prices it as, for a mechanism it has no model of (None:
      itself if built in, else its kind's stand-in).
    drafter: the drafter model takes it too when a recipe switches to it (its kind's drafter_field).
    presets: the built-in recipes it contributes.
    """

    kind: str
    name: str
    impl: Any
    doc: str = ""
    builtin: bool = False
    memory: float | Callable[[int], float] = 0.0
    curve: str | None = None
    constraints: tuple[Needs | Constraint, ...] = ()
    stand_in: str | None = None
    drafter: bool = False
    presets: tuple[Preset, ...] = ()

    @property
    def field(self) -> str:
        """The recipe field that selects it (its kind's)."""
        return KINDS[self.kind].field

    @property
    def value(self) -> str:
        """Its name as a recipe spells it (a plugin with its prefix)."""
        return self.name if self.builtin else PLUGIN_PREFIX + self.name

    def bytes_for(self, weights: int) -> float:
        """Private bytes its copy of models holding `weights` weights adds."""
        return self.memory(weights) if callable(self.memory) else self.memory * weights

    def violation(self, recipe: Any) -> str | None:
        """The first of its constraints `recipe` breaks, as the error to show, or None."""
        for c in self.constraints:
            if isinstance(c, Needs):
                if _get(recipe, c.field) != c.value:
                    return f"{self.field} = {self.value!r} {c.why}; set {c.field} = {c.value!r}"
            elif (message := c(recipe)) is not None:
                return message
        return None

    def settings(self) -> dict[str, dict[str, Any]]:
        """The recipe changes ({section: {key: value}}) that switch a recipe to it: its own field, what its
        Needs ask for, and its kind's drafter flag when the drafter takes it too."""
        pairs = [(self.field, self.value), *((c.field, c.value) for c in self.constraints if isinstance(c, Needs))]
        if self.drafter and KINDS[self.kind].drafter_field:
            pairs.append((KINDS[self.kind].drafter_field, True))
        out: dict[str, dict[str, Any]] = {}
        for dotted, value in pairs:
            section, key = dotted.split(".")
            out.setdefault(section, {})[key] = value
        return out


def _get(recipe: Any, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(recipe, section), key)


KINDS: dict[str, Kind] = {}
_MECHANISMS: dict[tuple[str, str], MechanismSpec] = {}
BUILTINS_MODULE = "specpilot.core.engine.builtins"


class UnknownMechanism(ValueError):
    """A recipe names a mechanism that is not registered; the message names the kind and the known names."""


def define_kind(name: str, field: str, interface: str, example: str, stand_in: str, drafter_field: str = "") -> None:
    """Declare a mechanism kind (core/engine/builtins.py does, once per kind); see Kind."""
    KINDS[name] = Kind(name, field, interface.strip("\n"), example.strip("\n"), stand_in, drafter_field)


def register(kind: str, name: str, impl: Any, doc: str = "", *, builtin: bool = False, **facts: Any) -> Any:
    """Register `impl` as mechanism `name` of `kind` with the facts MechanismSpec lists; returns `impl`.

    Built-ins and plugins use this one call; a built-in says so (`builtin=True`), and a built-in name is
    never registered again, so a plugin cannot shadow one."""
    ensure_builtins()
    if kind not in KINDS:
        raise UnknownMechanism(f"unknown mechanism kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not isinstance(name, str) or not name or name.startswith(PLUGIN_PREFIX):
        raise UnknownMechanism(f"{kind} name {name!r} must be a non-empty string without the {PLUGIN_PREFIX!r} "
                               "prefix (recipes add it)")
    old = _MECHANISMS.get((kind, name))
    if old is not None and old.builtin:
        raise UnknownMechanism(f"{kind} {name!r} is a built-in; give the plugin another name")
    _MECHANISMS[(kind, name)] = MechanismSpec(kind, name, impl, doc, builtin, **facts)
    return impl


def ensure_builtins() -> None:
    """Register the built-in mechanisms once (they register through `register`, like plugins)."""
    if BUILTINS_MODULE not in sys.modules:
        importlib.import_module(BUILTINS_MODULE)


def kinds() -> dict[str, Kind]:
    """Every mechanism kind, built-ins registered."""
    ensure_builtins()
    return KINDS


def specs(kind: str | None = None) -> list[MechanismSpec]:
    """The built-in mechanisms of `kind` (None: of every kind), in registration order."""
    ensure_builtins()
    return [m for m in _MECHANISMS.values() if m.builtin and kind in (None, m.kind)]


def names(kind: str, builtin: bool | None = None) -> list[str]:
    """Registered names of `kind` as a recipe spells them (plugins with their prefix), sorted."""
    ensure_builtins()
    return sorted(m.value for m in _MECHANISMS.values() if m.kind == kind and (builtin is None or m.builtin == builtin))


def builtin_names(kind: str) -> tuple[str, ...]:
    """The built-in names of `kind`, in registration order."""
    return tuple(m.name for m in specs(kind))


def _known(kind: str, extra: set[str] = frozenset()) -> str:
    """Built-ins in registration order, then the plugins known here."""
    plugins = sorted((set(names(kind, builtin=False)) | set(extra)) - set(builtin_names(kind)))
    return ", ".join([*builtin_names(kind), *plugins])


def lookup(kind: str, value: str) -> Any:
    """The implementation a recipe value names (bare = built-in, `plugin:NAME` = a registered plugin)."""
    mech = find(kind, value)
    if mech is None:
        raise UnknownMechanism(_unknown(kind, value))
    return mech.impl


def find(kind: str, value: str) -> MechanismSpec | None:
    """The spec a recipe value names, or None where it names nothing registered in this process."""
    ensure_builtins()
    if not isinstance(value, str):
        return None
    plugin = value.startswith(PLUGIN_PREFIX)
    mech = _MECHANISMS.get((kind, value.removeprefix(PLUGIN_PREFIX)))
    if mech is None or mech.builtin == plugin:
        return None
    return mech


def curve(kind: str, value: str) -> str | None:
    """The cost model's curve key of the mechanism a recipe value names (None: none of its own)."""
    mech = find(kind, value)
    return mech.curve if mech is not None else None


def own_curves(kind: str) -> dict[str, str]:
    """Curve key -> name of each built-in of `kind` priced on a measured curve of its own (the weight formats
    that run their own kernel, the approximate drafter formats, every linear backend)."""
    return {mech.curve: mech.name for mech in specs(kind) if mech.curve}


def _unknown(kind: str, value: str, extra: set[str] = frozenset()) -> str:
    field = KINDS[kind].field if kind in KINDS else kind
    hint = (f"; add plugins/{value.removeprefix(PLUGIN_PREFIX)}.py registering it to the workspace"
            if isinstance(value, str) and value.startswith(PLUGIN_PREFIX) else "")
    return f"{field} = {value!r} is not allowed; allowed: {_known(kind, extra)} (registered {kind} names){hint}"


def check_builtin_name(kind: str, value: Any) -> None:
    """Recipe validation: a bare name must be a built-in of `kind`; a `plugin:NAME` must be well formed.
    Whether the plugin exists is checked by `check_recipe`, where the workspace is known."""
    if isinstance(value, str) and value.startswith(PLUGIN_PREFIX) and PLUGIN_NAME.fullmatch(value[len(PLUGIN_PREFIX):]):
        return
    if find(kind, value) is None:
        raise UnknownMechanism(_unknown(kind, value))


def violation(recipe: Any) -> str | None:
    """The first constraint that a mechanism the recipe names (and this process registered) puts on its
    other fields and the recipe breaks, as the error to show; None when it breaks none."""
    for kind, value in recipe_mechanisms(recipe):
        mech = find(kind, value)
        if mech is not None and (message := mech.violation(recipe)) is not None:
            return message
    return None


def declared(workspace: str | Path | None) -> set[tuple[str, str]]:
    """(kind, name) pairs a workspace's plugin files register, read from their text without running them."""
    if workspace is None:
        return set()
    return set().union(*(declared_in(p) for p in sorted((Path(workspace) / "plugins").glob("*.py"))))


def declared_in(path: Path) -> set[tuple[str, str]]:
    """(kind, name) pairs one plugin file registers: calls `register("kind", "name", ...)` and
    `register_tree_policy("name", ...)` with literal arguments, found by parsing, never by running it.
    A call marked `builtin=True` declares no plugin (a workspace cannot add built-ins)."""
    found: set[tuple[str, str]] = set()
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return found
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
        if any(k.arg == "builtin" for k in node.keywords):
            continue
        if fn == "register" and len(args) >= 2 and args[0] and args[1]:
            found.add((args[0], args[1]))
        elif fn == "register_tree_policy" and args and args[0]:
            found.add(("tree_policy", args[0]))
    return found


def recipe_mechanisms(recipe: Any) -> list[tuple[str, str]]:
    """(kind, value) of every mechanism a recipe names, in kind order."""
    ensure_builtins()
    return [(kind.name, _get(recipe, kind.field)) for kind in KINDS.values()]


def check_recipe(recipe: Any, workspace: str | Path | None = None) -> None:
    """Every mechanism the recipe names is registered here, or (for plugins, with `workspace`) declared by
    one of the workspace's plugin files; raises UnknownMechanism naming the first that is not."""
    decl = declared(workspace)
    for kind, value in recipe_mechanisms(recipe):
        if find(kind, value) is not None:
            continue
        if value.startswith(PLUGIN_PREFIX) and (kind, value.removeprefix(PLUGIN_PREFIX)) in decl:
            continue
        extra = {PLUGIN_PREFIX + n for k, n in decl if k == kind}
        raise UnknownMechanism(_unknown(kind, value, extra))


def stand_in(kind: str, value: str) -> str:
    """What the agents' cost model prices a recipe value as: a built-in as itself unless its spec names a
    stand-in; a plugin as its spec's stand-in, or (never imported here) as its kind's."""
    mech = find(kind, value)
    if mech is not None and mech.stand_in:
        return mech.stand_in
    return KINDS[kind].stand_in if value.startswith(PLUGIN_PREFIX) else value


def modelled(recipe: Any) -> Any:
    """The recipe with each mechanism the cost model has no model of replaced by its stand-in (see
    `stand_in`): plugins are candidate code that the loop's process never imports, so its cost model
    profiles such a recipe this way (a plugin tree policy as a depth-matched chain, a plugin draft length as
    the full depth)."""
    changes: dict[str, dict[str, str]] = {}
    for kind, value in recipe_mechanisms(recipe):
        other = stand_in(kind, value)
        if other != value:
            section, key = KINDS[kind].field.split(".")
            changes.setdefault(section, {})[key] = other
    return recipe.replace(**changes) if changes else recipe


def interfaces_doc() -> str:
    """The plugin interface documentation agents receive, generated from the registered kinds."""
    ensure_builtins()
    parts = [
        "Plugin interfaces (code an agent may add to the run workspace)",
        "",
        "A plugin is one file `plugins/<name>.py` in the run workspace that registers one or more mechanisms",
        "when imported, through the same call the built-ins use:",
        "",
        "    from specpilot.core.mechanisms import register",
        "    register(KIND, \"<name>\", implementation)",
        "",
        "(`specpilot.core.engine.plugins.register_tree_policy(name, fn)` is the older spelling for a tree policy.)",
        "A recipe selects it with the `plugin:` prefix in the kind's field, e.g. draft.length = \"plugin:<name>\".",
        "Plugin files import only the standard library, math, numpy, torch, specpilot.core.engine and specpilot.core.mechanisms;",
        "they run in the judge's worker subprocess, never in the loop process, and must be deterministic",
        "(no clocks, no files, no unseeded randomness). Token forcing checks every output against the",
        "reference, so a plugin only changes how fast the output comes, never what it is.",
    ]
    for kind in KINDS.values():
        parts += ["", f"## {kind.name} (recipe field {kind.field}; built-ins: {', '.join(builtin_names(kind.name))})",
                  "", kind.interface, "", "Example:", "",
                  *(("    " + line).rstrip() for line in kind.example.splitlines())]
    return "\n".join(parts) + "\n"
