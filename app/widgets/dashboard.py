"""The dashboard: header, the four panels (tabs when small, a grid when large) and the status line.

Live events and replayed ones enter through `feed`; both end in `DashboardState.apply` and the same
panel refresh. Chunks of streamed text are buffered and drained a few times a second inside one
`batch_update`, other events drain at once (with any chunks before them, so order is kept).
"""

from __future__ import annotations

from typing import Any, Callable

from textual.app import ComposeResult
from textual.containers import Container, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Static, TabbedContent, TabPane, Tabs

from specpilot.app.screens.diff import DiffScreen
from specpilot.app.state import PANELS, Alert, DashboardState
from specpilot.app.widgets.candidates import CandidatesPanel, CandidateTable
from specpilot.app.widgets.forcing import ForcingTable
from specpilot.app.widgets.gaps import GapBars, gap_title
from specpilot.app.widgets.header import StatusHeader, StatusLine
from specpilot.app.widgets.speedup import SpeedupPlot
from specpilot.core.events import Error, Event, Notice

DRAIN_INTERVAL = 0.15
WIDE_MIN = (120, 35)
TABS = (("tab-candidates", "Candidates"), ("tab-gaps", "Gaps"), ("tab-forcing", "Forcing"),
        ("tab-speedup", "Speedup"))
PANEL_IDS = {"tab-candidates": "candidates-panel", "tab-gaps": "gaps-panel", "tab-forcing": "forcing-panel",
             "tab-speedup": "speedup-panel"}
FORCING_EMPTY = "no forcing result yet: each candidate's outputs are re-scored here once it passes its smoke run"


class Panel(Vertical):
    """A bordered panel; its title may follow the state (set on mount and on `sync_title`)."""

    def __init__(self, *children: Widget, title: str | Callable[[], str], **kwargs: Any) -> None:
        super().__init__(*children, **kwargs)
        self._title = title

    def on_mount(self) -> None:
        self.sync_title()

    def sync_title(self) -> None:
        self.border_title = self._title() if callable(self._title) else self._title


class Dashboard(Widget):
    """Renders a DashboardState; `wide` switches between tabs and a tiled grid."""

    wide: reactive[bool] = reactive(False, recompose=True)

    def __init__(self, state: DashboardState | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state or DashboardState()
        self.pending: list[Event] = []
        self.selected_cid: str | None = None
        self.active_tab = TABS[0][0]

    def compose(self) -> ComposeResult:
        self.set_reactive(Dashboard.wide, self._want_wide())
        yield StatusHeader(self.state, id="header")
        panels = {
            "tab-candidates": Panel(CandidatesPanel(self.state, lambda: self.selected_cid), title="Candidates · pred, meas: speedup vs the incumbent (meas: held-out)",
                                    id="candidates-panel", classes="panel"),
            "tab-gaps": Panel(GapBars(self.state, id="gaps"), title=lambda: gap_title(self.state.gaps),
                              id="gaps-panel", classes="panel"),
            "tab-forcing": Panel(ForcingTable(self.state, id="forcing"),
                                 Static(FORCING_EMPTY, id="forcing-empty"), title="Token forcing · threshold: stock's own rate + 0.5 pp",
                                 id="forcing-panel", classes="panel"),
            "tab-speedup": Panel(SpeedupPlot(self.state, id="speedup"), title="Speedup over AR",
                                 id="speedup-panel", classes="panel"),
        }
        if self.wide:
            with Container(id="grid"):
                for key in ("tab-gaps", "tab-candidates", "tab-speedup", "tab-forcing"):
                    yield panels[key]
        else:
            with TabbedContent(initial=self.active_tab, id="tabs"):
                for key, title in TABS:
                    with TabPane(title, id=key):
                        yield panels[key]
        yield StatusLine(self.state, id="status")
        self.call_after_refresh(self._focus_table)

    def _focus_table(self) -> None:
        """Arrow keys act on the candidates from the start (not on the tab strip)."""
        focused = self.screen.focused
        if focused is None or focused.parent is None or isinstance(focused, Tabs) or not focused.is_attached:
            tables = self.query(CandidateTable)
            if tables:
                tables.first().focus()

    def show_panel(self, index: int) -> None:
        """Keys 1-4: bring a panel up (its tab when small) and focus what can be focused in it."""
        key = TABS[index][0]
        for tabs in self.query(TabbedContent):
            tabs.active = key
            self.active_tab = key
        panel = self.query_one(f"#{PANEL_IDS[key]}")
        focusable = [w for w in panel.query("*") if w.focusable]
        if focusable:
            focusable[0].focus()

    def on_mount(self) -> None:
        self.set_interval(DRAIN_INTERVAL, self.drain)
        self.set_interval(1.0, self._tick)
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self.refresh_panels(set(PANELS), True))

    def _want_wide(self) -> bool:
        width, height = self.app.size
        return width >= WIDE_MIN[0] and height >= WIDE_MIN[1]

    def on_resize(self) -> None:
        self.wide = self._want_wide()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id:
            self.active_tab = event.pane.id

    def feed(self, event: Event) -> None:
        """Take one event (live or replayed); streamed chunks wait for the next drain."""
        self.pending.append(event)
        if event.kind != "agent_chunk":
            self.drain()

    def drain(self) -> None:
        """Apply the buffered events in one batch and refresh what they changed."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        with self.app.batch_update():
            self.refresh_panels(self.state.apply_all(events))
            if any(e.kind in ("awaiting_decision", "decision") for e in events):
                self._select_awaiting()
        self._notify(self.state.take_alerts())

    def _tick(self) -> None:
        """A live step's elapsed time and ETA move on between its progress events."""
        if self.state.clock is not None and self.state.progress is not None:
            for line in self.query(StatusLine):
                line.sync()

    def _select_awaiting(self) -> None:
        """Put the cursor on the first candidate waiting for a decision, unless it already is on one,
        so `a` and `r` act on what the loop is waiting for (after an approval or a rejection too)."""
        waiting = self.state.awaiting()
        current = self.state.candidates.get(self.current_cid or "")
        if waiting and (current is None or current.state != "awaiting"):
            self.selected_cid = waiting[0]
            for table in self.query(CandidateTable):
                table.select(waiting[0])

    def load(self, events: list[Event]) -> None:
        """Show the state at the end of `events` at once (replay), without notifications."""
        self.pending.clear()
        self.state.reset()
        self.state.apply_all(events)
        self.state.take_alerts()
        with self.app.batch_update():
            self.refresh_panels(set(PANELS))

    def report(self, message: str, severity: str = "error") -> None:
        """Show a UI-side problem exactly like a core `error`/`notice` event."""
        self.feed(Event.of(Error(message) if severity == "error" else Notice(message)))

    def _notify(self, alerts: list[Alert]) -> None:
        """Toasts for warnings, errors and the run's end; notices only update the status line."""
        for alert in alerts:
            if alert.toast:
                self.app.notify(alert.message, severity=alert.severity,
                                timeout=10 if alert.severity == "error" else 5)

    def refresh_panels(self, changed: set[str], restyle: bool = False) -> None:
        """Refresh the widgets whose panels changed (all of them after a theme change)."""
        if "header" in changed:
            for header in self.query(StatusHeader):
                header.sync()
        if "status" in changed:
            for line in self.query(StatusLine):
                line.sync()
        if "gaps" in changed:
            for gaps in self.query(GapBars):
                gaps.sync()
            for panel in self.query(Panel):
                panel.sync_title()
        if "forcing" in changed:
            for table in self.query(ForcingTable):
                table.sync(restyle)
            for note in self.query("#forcing-empty"):
                note.display = not self.state.forcing
        if "speedup" in changed:
            for plot in self.query(SpeedupPlot):
                plot.sync(restyle)
        for panel in self.query(CandidatesPanel):
            if "candidates" in changed:
                panel.sync(restyle)
            if changed & {"candidates", "stream"}:
                panel.sync_stream(restyle)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if isinstance(event.data_table, CandidateTable):
            self.selected_cid = str(event.row_key.value) if event.row_key is not None else None
            for panel in self.query(CandidatesPanel):
                panel.sync_stream()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        cid = str(event.row_key.value)
        if isinstance(event.data_table, ForcingTable):
            for table in self.query(CandidateTable):
                table.select(cid)
        self.open_diff(cid)

    @property
    def current_cid(self) -> str | None:
        """The candidate under the table cursor."""
        tables = self.query(CandidateTable)
        return tables.first().selected_cid if tables else self.selected_cid

    def open_diff(self, cid: str | None = None) -> None:
        """Show a candidate's full proposal in a modal."""
        cid = cid or self.current_cid
        cand = self.state.candidates.get(cid or "")
        if cand is None:
            self.app.notify("no candidate selected", severity="warning")
            return
        self.app.push_screen(DiffScreen(cand, self.state.forcing.get(cand.cid)))
