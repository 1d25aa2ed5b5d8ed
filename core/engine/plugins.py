"""Plugins: mechanisms registered by name, including agent-written ones from a run's workspace.

A workspace plugin is a file `plugins/<name>.py` that calls `register_tree_policy(name, fn)`, where
`fn(tree_section) -> list[list[int]]` returns a static tree as rank paths; recipes select it with
`[tree] policy = "plugin:<name>"`. Workspace plugins are imported only inside judge worker processes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from core.recipe import PLUGIN_PREFIX

TreePolicy = Callable[[object], list[list[int]]]
_TREE_POLICIES: dict[str, TreePolicy] = {}


class PluginError(ValueError):
    """A plugin that is missing or broken."""


def register_tree_policy(name: str, fn: TreePolicy) -> None:
    _TREE_POLICIES[name] = fn


def tree_policy(policy: str) -> TreePolicy:
    name = policy.removeprefix(PLUGIN_PREFIX)
    if name not in _TREE_POLICIES:
        known = ", ".join(sorted(_TREE_POLICIES)) or "none loaded"
        raise PluginError(f"tree policy plugin {name!r} is not registered ({known}); "
                          f"add plugins/{name}.py to the workspace")
    return _TREE_POLICIES[name]


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
