"""Command palette provider: every dashboard action, searchable by name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("Approve selected candidate", "approve", "a — only candidates that passed every gate"),
    ("Reject selected candidate", "reject", "r — asks for an optional note"),
    ("Pause / resume the loop", "toggle_pause", "space"),
    ("Show the selected candidate's full diff", "full_diff", "enter"),
    ("Runs and replay", "runs", "R — stored runs and rounds"),
    ("Next theme", "cycle_theme", "t — dark, light, monochrome"),
    ("Help: keys", "help", "?"),
    ("Quit SpecPilot", "quit", "q"),
)


class SpecPilotCommands(Provider):
    """The app's actions that apply on the current screen."""

    def _available(self) -> list[tuple[str, str, str]]:
        applies = getattr(self.app, "action_applies", None)
        return [c for c in COMMANDS if applies is None or applies(c[1], self.screen)]

    async def discover(self) -> Hits:
        for name, action, help_text in self._available():
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, action, help_text in self._available():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action), help=help_text)
