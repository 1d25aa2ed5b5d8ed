"""Validated mechanisms across rounds, runs and deployments: what an entry is, what it means, and how a
remembered one applies to a recipe. The store keeps the rows (core/store/db.py); the loop writes winners and
rejections through here; the memory agent and the rejection check read them through here.

An entry: mechanism (a name), description, fragment (the recipe fields it changed), fingerprint (the
deployment it was measured on), effect (held-out speedup; None for a rejection) and evidence (run, round,
cid, intervals, the plugin sources it needs; a rejection's evidence has decision "reject" and the note).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specpilot.core.recipe import Recipe, RecipeError, changed_fields


def is_rejection(entry: dict) -> bool:
    """A memory entry that records a person's rejection, not a validated win."""
    return (entry.get("evidence") or {}).get("decision") == "reject"


def ranked(entries: list[dict], fingerprint: str | None) -> list[dict]:
    """Entries in the order agents read them: this deployment's first, then others; each group by effect,
    largest first (rejections, with no effect, last); ties in the order they were stored."""
    return sorted(entries, key=lambda e: (e.get("fingerprint") != fingerprint, e.get("effect") is None,
                                          -(e.get("effect") or 0.0), e.get("id") or 0))


def split(entries: list[dict], run_id: int | None) -> tuple[list[dict], list[dict]]:
    """(validated mechanisms, this run's rejections) of the stored entries: another run's rejection is
    not this run's person's say."""
    validated = [m for m in entries if not is_rejection(m)]
    rejected = [m for m in entries if is_rejection(m) and (m.get("evidence") or {}).get("run") == run_id]
    return validated, rejected


def effect_of(entry: dict[str, Any]) -> float | None:
    """The remembered speedup, whether stored as a number or as {'heldout_speedup': x, ...}."""
    effect = entry.get("effect")
    if isinstance(effect, dict):
        effect = effect.get("heldout_speedup", effect.get("speedup"))
    return float(effect) if isinstance(effect, (int, float)) else None


def winner_entry(title: str, rationale: str, recipe: Recipe, previous: Recipe, fingerprint: str,
                 heldout: Any, tuning: Any, where: dict[str, Any], workspace: Path) -> dict[str, Any]:
    """A winner's entry: the fields it changed relative to the incumbent it was made against, with its
    held-out evidence and the plugin sources a later run needs to re-propose it."""
    plugins = plugin_sources(recipe, workspace)
    return {"mechanism": title, "description": rationale, "fragment": changed_fields(recipe, previous),
            "fingerprint": fingerprint, "effect": heldout.speedup,
            "evidence": {**where, "interval": [heldout.low, heldout.high], "tuning": tuning.to_dict(),
                         "heldout": heldout.to_dict(), **({"plugins": plugins} if plugins else {})}}


def rejection_entry(title: str, note: str, rationale: str, recipe: Recipe, previous: Recipe, fingerprint: str,
                    where: dict[str, Any]) -> dict[str, Any]:
    """A rejected candidate's entry (marked as a rejection, the note verbatim), so later rounds and a
    resumed run do not propose it again."""
    return {"mechanism": title, "description": note or rationale, "fragment": changed_fields(recipe, previous),
            "fingerprint": fingerprint, "effect": None, "evidence": {"decision": "reject", "note": note, **where}}


def rejection_of(recipe: Recipe, incumbent: Recipe, rejected: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rejection `recipe` repeats: one whose every changed field it changes to the same value."""
    mine = changed_fields(recipe, incumbent)
    for entry in rejected:
        fragment = entry.get("fragment") or {}
        if fragment and all(isinstance(f, dict) and f and all(mine.get(sec, {}).get(k, object()) == v
                                                              for k, v in f.items())
                            for sec, f in fragment.items()):
            return entry
    return None


def rejection_line(entry: dict[str, Any]) -> str:
    """One rejection as a person reads it: what, when, and the note verbatim."""
    ev = entry.get("evidence") or {}
    note = ev.get("note") or ""
    return (f"{entry.get('mechanism', 'a change')} (rejected in round {ev.get('round', '?')}"
            + (f": \"{note}\")" if note else ", no note)"))


def apply_fragment(recipe: Recipe, fragment: dict[str, Any]) -> Recipe:
    """The recipe with a remembered fragment's sections and fields set (validated)."""
    return recipe.replace(**{s: dict(f) for s, f in fragment.items() if isinstance(f, dict)}).validate()


def applicable(memory: list[dict[str, Any]], recipe: Recipe | None) -> list[tuple[dict[str, Any], Recipe | None]]:
    """Entries whose fragment is valid and not already in `recipe` (all entries with a fragment if None)."""
    out = []
    for entry in memory:
        fragment = entry.get("fragment") or {}
        if not isinstance(fragment, dict) or not fragment:
            continue
        if recipe is None:
            out.append((entry, None))
            continue
        try:
            new = apply_fragment(recipe, fragment)
        except (RecipeError, TypeError, KeyError, ValueError):
            continue
        if new.to_toml() != recipe.to_toml():
            out.append((entry, new))
    return out


def plugin_sources(recipe: Recipe, workspace: Path) -> dict[str, str]:
    """The workspace plugin files that register a plugin the recipe names (path -> source), so memory can
    re-propose the mechanism in a later run; read as text, never imported."""
    from specpilot.core.mechanisms import PLUGIN_PREFIX, declared_in, recipe_mechanisms

    wanted = {(k, v.removeprefix(PLUGIN_PREFIX)) for k, v in recipe_mechanisms(recipe) if v.startswith(PLUGIN_PREFIX)}
    return {f"plugins/{path.name}": path.read_text() for path in sorted((workspace / "plugins").glob("*.py"))
            if wanted & declared_in(path)}


def remembered_plugins(entries: list[dict[str, Any]], workspace: Any) -> dict[str, str]:
    """The plugin sources stored with remembered winners (evidence.plugins), minus files the workspace
    already holds unchanged: what re-proposing those mechanisms needs."""
    files: dict[str, str] = {}
    for entry in entries:
        evidence = entry.get("evidence") if isinstance(entry.get("evidence"), dict) else {}
        for path, text in (evidence.get("plugins") or {}).items():
            here = Path(workspace) / path
            if isinstance(text, str) and not (here.is_file() and here.read_text() == text):
                files[str(path)] = text
    return files
