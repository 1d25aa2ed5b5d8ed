"""The runs screen: stored runs and their rounds; enter opens a round's replay."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from specpilot.app.bridge import StoreLike, one_line
from specpilot.app.screens.replay import ReplayScreen
from specpilot.app.state import model_names

RUN_COLUMNS = ("run", "started", "status", "deployment", "rounds", "best")


def fmt_time(value: Any) -> str:
    """A stored timestamp (epoch seconds, datetime or text) as 'YYYY-MM-DD HH:MM'."""
    if value in (None, ""):
        return "—"
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value)
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    return str(value)[:16]


def fmt_speedup(value: Any) -> str:
    return f"{float(value):.2f}x" if isinstance(value, (int, float)) else "—"


def round_details(info: dict[str, Any]) -> str:
    """A short description of a stored round: candidates, incumbent speedup, finished or not."""
    parts = []
    if isinstance(info.get("candidates"), int):
        parts.append(f"{info['candidates']} candidates")
    if info.get("failed_proposals"):
        parts.append(f"{info['failed_proposals']} agents proposed nothing")
    incumbent = info.get("incumbent")
    if isinstance(incumbent, dict) and isinstance(incumbent.get("heldout_speedup_vs_ar"), (int, float)):
        parts.append(f"incumbent {incumbent['heldout_speedup_vs_ar']:.2f}x AR")
    if "finished_at" in info:
        parts.append("finished" if info["finished_at"] else "unfinished")
    return " · ".join(parts)


class RunsScreen(Screen[None]):
    """Runs on top, the highlighted run's rounds below."""

    BINDINGS = [Binding("escape", "back", "Back")]

    def __init__(self, store: StoreLike, source: str = "") -> None:
        super().__init__()
        self.store = store
        self.source = source
        self.run_id: Any = None
        self.rounds: list[int] = []

    def compose(self) -> ComposeResult:
        yield Static(f" Runs · {self.source}" if self.source else " Runs", id="runs-title")
        yield DataTable(id="runs", cursor_type="row")
        yield Static(" Rounds · enter opens the replay", id="rounds-title")
        yield DataTable(id="rounds", cursor_type="row")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        runs = self.query_one("#runs", DataTable)
        for key in RUN_COLUMNS:
            runs.add_column(key, key=key)
        self.query_one("#rounds", DataTable).add_columns("round", "details")
        self.reload()
        runs.focus()

    def reload(self) -> None:
        """Re-read the runs from the store."""
        table = self.query_one("#runs", DataTable)
        table.clear()
        try:
            runs = self.store.list_runs()
        except Exception as exc:
            self.app.notify(f"cannot read runs: {one_line(exc)}", severity="error")
            return
        for run in runs:
            dep = run.get("deployment") or {}
            table.add_row(str(run.get("id")), fmt_time(run.get("started_at")), str(run.get("status", "")),
                          model_names(dep),
                          str(run.get("rounds", "")), fmt_speedup(run.get("best_heldout_speedup")),
                          key=str(run.get("id")))
        if not runs:
            self.query_one("#rounds-title", Static).update(" No runs stored yet")

    def show_rounds(self, run_id: str) -> None:
        """Fill the rounds table for one run."""
        table = self.query_one("#rounds", DataTable)
        table.clear()
        self.run_id, self.rounds = run_id, []
        try:
            rounds = self.store.list_rounds(_run_key(run_id))
        except Exception as exc:
            self.app.notify(f"cannot read rounds of run {run_id}: {one_line(exc)}", severity="error")
            return
        for info in rounds:
            index = int(info["index"])
            self.rounds.append(index)
            table.add_row(str(index), round_details(info), key=str(index))
        self.query_one("#rounds-title", Static).update(
            f" Rounds of run {run_id} · enter opens the replay" if rounds else
            f" Run {run_id} has no finished round · enter on the run replays all its events")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "runs" and event.row_key is not None:
            self.show_rounds(str(event.row_key.value))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.data_table.id == "runs":
            if self.rounds:
                self.query_one("#rounds", DataTable).focus()
            else:
                self.open(str(event.row_key.value), None)
        else:
            self.open(self.run_id, int(str(event.row_key.value)))

    def open(self, run_id: str, index: int | None) -> None:
        """Replay `run_id` at the end of round `index` (None: its last round, or all its events)."""
        if str(run_id) not in {str(k.value) for k in self.query_one("#runs", DataTable).rows}:
            self.app.notify(f"no run {run_id} in {self.source or 'the store'}", severity="error")
            return
        if run_id != self.run_id:
            self.show_rounds(run_id)
        if index is None and self.rounds:
            index = self.rounds[-1]
        self.app.push_screen(ReplayScreen(self.store, _run_key(run_id), self.rounds, index))

    def action_back(self) -> None:
        self.app.pop_screen()


def _run_key(run_id: Any) -> Any:
    """Store run ids are integers when they look like one."""
    text = str(run_id)
    return int(text) if text.isdigit() else run_id
