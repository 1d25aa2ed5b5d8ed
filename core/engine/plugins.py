"""Workspace plugins: agent-written mechanisms of any kind, imported only inside judge worker processes.

A workspace plugin is a file `plugins/<name>.py` that registers mechanisms when imported, through the call
the built-ins use (`specpilot.core.mechanisms.register(kind, name, impl)`); recipes select one with the
`plugin:` prefix, e.g. `[draft] length = "plugin:<name>"`. `register_tree_policy` is the older spelling
for a tree policy, kept so stored plugins still load.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Callable

from specpilot.core.mechanisms import UnknownMechanism, lookup, register

TreePolicy = Callable[[object], list[list[int]]]
PACKAGES = ("core", "app", "kernels", "themes")  # installed under specpilot. since 0.1; plugins stored before say core.


class PluginError(ValueError):
    """A plugin that is missing or broken."""


def register_tree_policy(name: str, fn: TreePolicy) -> None:
    """Register a tree-policy plugin (the same as register("tree_policy", name, fn))."""
    register("tree_policy", name, fn)


def tree_policy(policy: str) -> TreePolicy:
    try:
        return lookup("tree_policy", policy)
    except UnknownMechanism as exc:
        raise PluginError(str(exc)) from None


def load_workspace(workspace: str | Path) -> list[str]:
    """Import every plugins/*.py file of a workspace; returns the module names loaded."""
    loaded = []
    for path in sorted((Path(workspace) / "plugins").glob("*.py")):
        _check_imports(path)
        spec = importlib.util.spec_from_file_location(f"specpilot_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise PluginError(f"plugin {path.name} failed to import: {type(exc).__name__}: {exc}") from None
        loaded.append(path.stem)
    return loaded


def _check_imports(path: Path) -> None:
    """Refuse a plugin that imports SpecPilot's modules by their old top-level names (`from core.mechanisms
    import register`, as plugins stored before the specpilot namespace do): run from the repo root those names
    would load a second copy of the registry, and the plugin's mechanisms would silently be missing."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=path.name)
    except SyntaxError as exc:
        raise PluginError(f"plugin {path.name} failed to import: SyntaxError: {exc}") from None
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for name in names:
            if name.split(".")[0] in PACKAGES:
                raise PluginError(f"plugin {path.name} imports {name}; SpecPilot's modules are specpilot.{name} "
                                  f"now: change the import to `specpilot.{name}`")
