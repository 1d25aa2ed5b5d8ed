"""One registry for every mechanism a recipe names, keyed by (kind, name).

Built-ins (core/engine/builtins.py) and workspace plugins register through the same `register` call, so
the engine looks every mechanism up here instead of branching on strings, and an unknown name is an error
that lists the known ones, never a silent fallback. A recipe names a built-in bare (`"greedy"`) and a
plugin with the `plugin:` prefix (`"plugin:adaptive"`); a plugin can never shadow a built-in.

This module imports nothing heavy (no torch), so a recipe can be validated anywhere, including the loop's
process, which never imports candidate code: there a plugin name is checked against the workspace's plugin
files read as text (`declared`), never executed.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLUGIN_PREFIX = "plugin:"
PLUGIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Kind:
    """A mechanism kind: the recipe field that names it, its interface and one short example plugin."""

    name: str
    field: str
    interface: str
    example: str


KINDS: dict[str, Kind] = {}


@dataclass
class Mechanism:
    kind: str
    name: str
    impl: Any
    doc: str
    builtin: bool


_MECHANISMS: dict[tuple[str, str], Mechanism] = {}
BUILTINS_MODULE = "core.engine.builtins"


class UnknownMechanism(ValueError):
    """A recipe names a mechanism that is not registered; the message names the kind and the known names."""


def define_kind(name: str, field: str, interface: str, example: str) -> None:
    KINDS[name] = Kind(name, field, interface.strip("\n"), example.strip("\n"))


def register(kind: str, name: str, impl: Any, doc: str = "") -> Any:
    """Register `impl` as mechanism `name` of `kind` (built-ins and plugins alike); returns `impl`."""
    builtin = sys._getframe(1).f_globals.get("__name__") == BUILTINS_MODULE
    if not builtin:
        ensure_builtins()
    if kind not in KINDS:
        raise UnknownMechanism(f"unknown mechanism kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not isinstance(name, str) or not name or name.startswith(PLUGIN_PREFIX):
        raise UnknownMechanism(f"{kind} name {name!r} must be a non-empty string without the {PLUGIN_PREFIX!r} "
                               "prefix (recipes add it)")
    old = _MECHANISMS.get((kind, name))
    if old is not None and old.builtin and not builtin:
        raise UnknownMechanism(f"{kind} {name!r} is a built-in; give the plugin another name")
    _MECHANISMS[(kind, name)] = Mechanism(kind, name, impl, doc, builtin)
    return impl


def ensure_builtins() -> None:
    """Register the built-in mechanisms once (they register through `register`, like plugins)."""
    if BUILTINS_MODULE not in sys.modules:
        importlib.import_module(BUILTINS_MODULE)


def kinds() -> dict[str, Kind]:
    """Every mechanism kind, built-ins registered."""
    ensure_builtins()
    return KINDS


def names(kind: str, builtin: bool | None = None) -> list[str]:
    """Registered names of `kind` as a recipe spells them (plugins with their prefix), sorted."""
    ensure_builtins()
    out = [m.name if m.builtin else PLUGIN_PREFIX + m.name for m in _MECHANISMS.values()
           if m.kind == kind and (builtin is None or m.builtin == builtin)]
    return sorted(out)


def builtin_names(kind: str) -> tuple[str, ...]:
    ensure_builtins()
    return tuple(m.name for m in _MECHANISMS.values() if m.kind == kind and m.builtin)


def _known(kind: str, extra: set[str] = frozenset()) -> str:
    """Built-ins in registration order, then the plugins known here."""
    plugins = sorted((set(names(kind, builtin=False)) | set(extra)) - set(builtin_names(kind)))
    return ", ".join([*builtin_names(kind), *plugins])


def lookup(kind: str, value: str) -> Any:
    """The implementation a recipe value names (bare = built-in, `plugin:NAME` = a registered plugin)."""
    mech = _find(kind, value)
    if mech is None:
        raise UnknownMechanism(_unknown(kind, value))
    return mech.impl


def _find(kind: str, value: str) -> Mechanism | None:
    ensure_builtins()
    if not isinstance(value, str):
        return None
    plugin = value.startswith(PLUGIN_PREFIX)
    mech = _MECHANISMS.get((kind, value.removeprefix(PLUGIN_PREFIX)))
    if mech is None or mech.builtin == plugin:
        return None
    return mech


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
    if _find(kind, value) is None:
        raise UnknownMechanism(_unknown(kind, value))


def declared(workspace: str | Path | None) -> set[tuple[str, str]]:
    """(kind, name) pairs a workspace's plugin files register, read from their text without running them."""
    if workspace is None:
        return set()
    return set().union(*(declared_in(p) for p in sorted((Path(workspace) / "plugins").glob("*.py"))))


def declared_in(path: Path) -> set[tuple[str, str]]:
    """(kind, name) pairs one plugin file registers: calls `register("kind", "name", ...)` and
    `register_tree_policy("name", ...)` with literal arguments, found by parsing, never by running it."""
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
        if fn == "register" and len(args) >= 2 and args[0] and args[1]:
            found.add((args[0], args[1]))
        elif fn == "register_tree_policy" and args and args[0]:
            found.add(("tree_policy", args[0]))
    return found


def recipe_mechanisms(recipe: Any) -> list[tuple[str, str]]:
    """(kind, value) of every mechanism a recipe names."""
    ensure_builtins()
    out = []
    for kind in KINDS.values():
        section, key = kind.field.split(".")
        out.append((kind.name, getattr(getattr(recipe, section), key)))
    return out


def check_recipe(recipe: Any, workspace: str | Path | None = None) -> None:
    """Every mechanism the recipe names is registered here, or (for plugins, with `workspace`) declared by
    one of the workspace's plugin files; raises UnknownMechanism naming the first that is not."""
    decl = declared(workspace)
    for kind, value in recipe_mechanisms(recipe):
        if _find(kind, value) is not None:
            continue
        if value.startswith(PLUGIN_PREFIX) and (kind, value.removeprefix(PLUGIN_PREFIX)) in decl:
            continue
        extra = {PLUGIN_PREFIX + n for k, n in decl if k == kind}
        raise UnknownMechanism(_unknown(kind, value, extra))


STAND_INS = {"drafter": "model", "tree_policy": "chain", "draft_length": "fixed", "acceptance": "greedy",
             "batching": "fixed", "weight_format": "native", "linear_backend": "native",
             "drafter_format": "same"}


def modelled(recipe: Any) -> Any:
    """The recipe with each plugin mechanism replaced by its nearest built-in (STAND_INS): plugins are
    candidate code that the loop's process never imports, so its cost model profiles such a recipe this
    way (a plugin tree policy as a depth-matched chain, a plugin draft length as the full depth)."""
    changes: dict[str, dict[str, str]] = {}
    for kind, value in recipe_mechanisms(recipe):
        if isinstance(value, str) and value.startswith(PLUGIN_PREFIX):
            section, key = KINDS[kind].field.split(".")
            changes.setdefault(section, {})[key] = STAND_INS[kind]
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
        "    from core.mechanisms import register",
        "    register(KIND, \"<name>\", implementation)",
        "",
        "(`core.engine.plugins.register_tree_policy(name, fn)` is the older spelling for a tree policy.)",
        "A recipe selects it with the `plugin:` prefix in the kind's field, e.g. draft.length = \"plugin:<name>\".",
        "Plugin files import only the standard library, math, numpy, torch, core.engine and core.mechanisms;",
        "they run in the judge's worker subprocess, never in the loop process, and must be deterministic",
        "(no clocks, no files, no unseeded randomness). Token forcing checks every output against the",
        "reference, so a plugin only changes how fast the output comes, never what it is.",
    ]
    for kind in KINDS.values():
        parts += ["", f"## {kind.name} (recipe field {kind.field}; built-ins: {', '.join(builtin_names(kind.name))})",
                  "", kind.interface, "", "Example:", "",
                  *(("    " + line).rstrip() for line in kind.example.splitlines())]
    return "\n".join(parts) + "\n"
