"""Textual themes for the SpecPilot dashboard."""

from specpilot.themes.specpilot import DEFAULT_THEME, MONO_THEME, THEMES, VARIABLE_DEFAULTS

__all__ = ["DEFAULT_THEME", "MONO_THEME", "THEMES", "VARIABLE_DEFAULTS"]
