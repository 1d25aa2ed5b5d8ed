"""SpecPilot's Textual themes: dark, light, and a monochrome one for no-colour terminals.

The monochrome theme carries every distinction without colour: the widgets always print symbols and
words (✓/✗, PASS/FAIL, a marker on the largest gap), and the `spec-*-style` variables below turn the
emphasis into bold, reverse and underline.
"""

from __future__ import annotations

from textual.theme import Theme

VARIABLE_DEFAULTS: dict[str, str] = {
    "spec-largest-style": "bold",
    "spec-pass-style": "bold",
    "spec-fail-style": "bold",
    "spec-add-style": "none",
    "spec-del-style": "none",
    "spec-hunk-style": "bold",
}
"""Text styles the app's CSS uses; a theme may override any of them in `variables`."""

DARK = Theme(
    name="specpilot-dark",
    primary="#4EA8DE",
    secondary="#7F8FA6",
    accent="#FFB000",
    warning="#FFC857",
    error="#FF6B6B",
    success="#5FD068",
    foreground="#D8DEE9",
    background="#0F1318",
    surface="#161B22",
    panel="#1F2630",
    dark=True,
)

LIGHT = Theme(
    name="specpilot-light",
    primary="#1F5FAD",
    secondary="#56606B",
    accent="#B3541E",
    warning="#8A6100",
    error="#B3261E",
    success="#1A6E2E",
    foreground="#1B1F24",
    background="#FAFAF7",
    surface="#FFFFFF",
    panel="#E8EBEF",
    dark=False,
)

MONO = Theme(
    name="specpilot-mono",
    primary="#D0D0D0",
    secondary="#A0A0A0",
    accent="#FFFFFF",
    warning="#E0E0E0",
    error="#FFFFFF",
    success="#D0D0D0",
    foreground="#E0E0E0",
    background="#000000",
    surface="#0A0A0A",
    panel="#1C1C1C",
    dark=True,
    variables={
        "spec-largest-style": "bold underline",
        "spec-pass-style": "bold",
        "spec-fail-style": "bold reverse",
        "spec-add-style": "bold",
        "spec-del-style": "strike",
        "spec-hunk-style": "underline",
    },
)

THEMES: tuple[Theme, ...] = (DARK, LIGHT, MONO)
DEFAULT_THEME = DARK.name
MONO_THEME = MONO.name
