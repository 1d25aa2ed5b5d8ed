"""Workspace plugins: agent-written mechanisms of any kind, imported only inside judge worker processes.

A workspace plugin is a file `plugins/<name>.py` that registers mechanisms when imported, through the call
the built-ins use (`core.mechanisms.register(kind, name, impl)`); recipes select one with the
`plugin:` prefix, e.g. `[draft] length = "plugin:<name>"`. `register_tree_policy` is the older spelling
for a tree policy, kept so stored plugins still load.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from core.mechanisms import UnknownMechanism, lookup, register

TreePolicy = Callable[[object], list[list[int]]]


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
        spec = importlib.util.spec_from_file_location(f"specpilot_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise PluginError(f"plugin {path.name} failed to import: {type(exc).__name__}: {exc}") from None
        loaded.append(path.stem)
    return loaded
