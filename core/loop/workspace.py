"""A run's workspace files: one folder per candidate holding its plugin files, next to the store."""

from __future__ import annotations

import shutil
from pathlib import Path

from specpilot.core.diffs import PLUGIN_GLOB, AllowList, DiffError, checked_path


def checked_files(files: dict | None) -> dict[str, str]:
    """A candidate's plugin files, each path checked against the allow-list (plugins/<name>.py inside the
    workspace) by the same check diffs go through; raises DiffError naming the first path refused."""
    allow = AllowList((PLUGIN_GLOB,))
    out: dict[str, str] = {}
    for rel, text in (files or {}).items():
        clean = checked_path(str(rel), allow)
        if not isinstance(text, str):
            raise DiffError(f"{rel}: file content must be text")
        out[clean] = text
    return out


class Workspace:
    """`root/<cid>/plugins/*.py` for every candidate of one run (plugin code is written here, never into
    core/, and only judge workers import it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "plugins").mkdir(parents=True, exist_ok=True)

    def __truediv__(self, cid: str) -> Path:
        return self.root / cid

    def for_candidate(self, cid: str, incumbent: Path | None) -> Path:
        """A candidate's workspace starts with the incumbent's plugins, so agents see (and recipes keep
        using) the code the incumbent runs; one left by an abandoned attempt at this round is cleared."""
        ws = self.root / cid
        if ws.exists():
            shutil.rmtree(ws)
        (ws / "plugins").mkdir(parents=True, exist_ok=True)
        if incumbent is not None:
            _copy_plugins(Path(incumbent), ws)
        return ws

    def write(self, cid: str, files: dict | None) -> None:
        """Write a candidate's files into its workspace; every path is checked before any is written (the
        applies gate: nothing outside the allow-list is ever written)."""
        ws = self.root / cid
        for rel, text in checked_files(files).items():
            path = ws / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def merged(self, cid: str, sources: list[str]) -> Path:
        """A workspace holding the plugins of every candidate in `sources` (combined winners), and only those:
        one left by an abandoned attempt at this round is cleared first, as in for_candidate."""
        ws = self.root / cid
        if ws.exists():
            shutil.rmtree(ws)
        (ws / "plugins").mkdir(parents=True, exist_ok=True)
        for source in sources:
            _copy_plugins(self.root / source, ws)
        return ws


def _copy_plugins(source: Path, dest: Path) -> None:
    for f in (source / "plugins").glob("*.py"):
        (dest / "plugins" / f.name).write_text(f.read_text())
