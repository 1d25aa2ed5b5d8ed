"""User settings remembered between launches (the theme), in a small JSON file.

The file is `$SPECPILOT_CONFIG_DIR/settings.json`, else `$XDG_CONFIG_HOME/specpilot/settings.json`,
else `~/.config/specpilot/settings.json`. A missing or unreadable file means defaults; a failed write
is reported, never raised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def settings_path() -> Path:
    """Where settings live (see module docstring)."""
    explicit = os.environ.get("SPECPILOT_CONFIG_DIR")
    if explicit:
        return Path(explicit) / "settings.json"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specpilot" / "settings.json"


def load_settings(path: Path | None = None) -> dict[str, Any]:
    """The saved settings, or {} when there are none or the file is unreadable."""
    path = path or settings_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_setting(key: str, value: Any, path: Path | None = None) -> str | None:
    """Store one setting; return an error message instead of raising."""
    path = path or settings_path()
    data = load_settings(path)
    if data.get(key) == value:
        return None
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as exc:
        return f"could not save settings to {path}: {exc.strerror or exc}"
    return None
