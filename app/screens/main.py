"""The live screen: the dashboard the loop's events feed."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer

from specpilot.app.state import DashboardState
from specpilot.app.widgets.dashboard import Dashboard


class MainScreen(Screen[None]):
    """Dashboard + footer; the app routes live events to `dashboard.feed`."""

    BINDINGS = [Binding(str(i + 1), f"panel({i})", name, show=False) for i, name in
                enumerate(("Candidates", "Gaps", "Forcing", "Speedup"))]

    def __init__(self) -> None:
        super().__init__()
        self.dashboard = Dashboard(DashboardState(clock=time.monotonic), id="live")

    def compose(self) -> ComposeResult:
        yield self.dashboard
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.dashboard.refresh_panels({"forcing"})

    def action_panel(self, index: int) -> None:
        self.dashboard.show_panel(index)
