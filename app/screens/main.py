"""The live screen: the dashboard the loop's events feed."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from app.state import DashboardState
from app.widgets.dashboard import Dashboard


class MainScreen(Screen[None]):
    """Dashboard + footer; the app routes live events to `dashboard.feed`."""

    def __init__(self) -> None:
        super().__init__()
        self.dashboard = Dashboard(DashboardState(clock=time.monotonic), id="live")

    def compose(self) -> ComposeResult:
        yield self.dashboard
        yield Footer(compact=True)
