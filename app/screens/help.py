"""The help screen: keys and what they do."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
Live dashboard
  a          approve the selected candidate (it must pass every gate)
  r          reject the selected candidate, with an optional note
  space      pause / resume the loop (the step in flight finishes)
  enter      the selected candidate's full diff
  ↑ ↓        move in a table; tab / shift+tab: next / previous widget
  1 2 3 4    candidates, gaps, forcing, speedup (the tab, on small terminals)
  ← →        switch panels when they are tabs (small terminals)
  q          quit: stops the step in flight (workers killed); q again: leave at once

Runs and replay
  R          list stored runs and rounds; enter opens a round
  p          re-play the round's events (streamed diffs included)
  1 2 3 4    replay speed: 1x, 10x, 100x, instant
  [ ]        previous / next round
  escape     back

Anywhere
  t          next theme (dark, light, monochrome); remembered
  ctrl+p     command palette (every action is there)
  ?          this help
  q          quit
"""


class HelpScreen(ModalScreen[None]):
    """Lists the keys."""

    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False),
                Binding("enter", "dismiss", "Close", show=False)]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog") as box:
            box.border_title = "SpecPilot — keys"
            box.border_subtitle = "escape to close"
            yield Static(HELP, markup=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
