"""Candidates: a table keyed by candidate id, and the selected candidate's streaming diff below."""

from __future__ import annotations

from typing import Any, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from app.state import CandidateView, DashboardState
from app.widgets.diffview import DiffView

COLUMNS = (("cid", "cid", None), ("agent", "agent", None), ("title", "title", 24), ("state", "state", None),
           ("gates", "gates", None), ("pred", "pred", None), ("meas", "meas", None))


def speedup_cell(value: float | None) -> Text:
    return Text("—" if value is None else f"{value:.2f}x", justify="right")


class CandidateTable(DataTable):
    """One row per candidate of the current round, keyed by cid; cells update in place."""

    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES | {
        "candidate--good", "candidate--bad", "candidate--waiting", "candidate--plain"}

    def __init__(self, state: DashboardState, selected: Callable[[], str | None] = lambda: None,
                 **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.state = state
        self._selected = selected
        self._cells: dict[str, tuple[str, ...]] = {}
        self._ready = False

    def on_mount(self) -> None:
        for label, key, width in COLUMNS:
            self.add_column(label, key=key, width=width)
        self._ready = True
        self.sync()
        self.select(self._selected())  # the selection as of now: events may have moved it since compose

    def _state_style(self, cand: CandidateView) -> str:
        if cand.state in ("passed", "approved"):
            return "candidate--good"
        if cand.state.startswith("failed") or cand.state in ("agent failed", "rejected"):
            return "candidate--bad"
        if cand.state == "awaiting":
            return "candidate--waiting"
        return "candidate--plain"

    def _row(self, cand: CandidateView) -> tuple[Text, ...]:
        state_style = self.get_component_rich_style(self._state_style(cand))
        title = cand.title or (f"({cand.direction})" if cand.direction else "")
        return (Text(cand.cid), Text(cand.agent), Text(title), Text(cand.state, style=state_style),
                Text(cand.gate_marks), speedup_cell(cand.predicted), speedup_cell(cand.measured))

    def sync(self, restyle: bool = False) -> None:
        """Add, update (cell by cell) and remove rows to match the state."""
        if not self._ready:
            return
        state = self.state
        if restyle:
            self._cells.clear()
        for cid in [str(k.value) for k in self.rows if str(k.value) not in state.candidates]:
            self.remove_row(cid)
            self._cells.pop(cid, None)
        keys = [key for _, key, _ in COLUMNS]
        for cid, cand in state.candidates.items():
            row = self._row(cand)
            plain = tuple(cell.plain for cell in row)
            if cid not in self.rows:
                self.add_row(*row, key=cid)
            else:
                old = self._cells.get(cid) or ("",) * len(row)
                for key, cell, was in zip(keys, row, old):
                    if restyle or was != cell.plain:
                        self.update_cell(cid, key, cell)
            self._cells[cid] = plain

    @property
    def selected_cid(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
        except CellDoesNotExist:
            return None

    def select(self, cid: str | None) -> None:
        """Move the cursor to `cid` when it is in the table."""
        if cid is not None and cid in self.rows:
            self.move_cursor(row=self.get_row_index(cid))


class CandidatesPanel(Vertical):
    """The candidates table above the selected candidate's diff."""

    def __init__(self, state: DashboardState, selected: Callable[[], str | None] = lambda: None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state
        self._selected = selected

    def compose(self) -> ComposeResult:
        yield CandidateTable(self.state, self._selected, id="candidates")
        yield DiffView(placeholder="select a candidate to see its proposal", id="diff")

    def on_mount(self) -> None:
        self.sync_stream()

    @property
    def table(self) -> CandidateTable | None:
        tables = self.query(CandidateTable)
        return tables.first() if tables else None

    @property
    def selected_cid(self) -> str | None:
        return self.table.selected_cid if self.table else None

    def sync(self, restyle: bool = False) -> None:
        if self.table is not None:
            self.table.sync(restyle)

    def sync_stream(self, restyle: bool = False) -> None:
        """Show the selected candidate's text in the diff view."""
        views = self.query(DiffView)
        if not views:
            return
        view = views.first()
        cand = self.state.candidates.get(self.selected_cid or "")
        if cand is None:
            view.show("")
        elif cand.state == "agent failed" and not cand.text:
            view.show(f"agent {cand.agent} failed: {cand.failure}")
        else:
            view.show(cand.text, follow=cand.state == "streaming")
        if restyle:
            view.restyle()
