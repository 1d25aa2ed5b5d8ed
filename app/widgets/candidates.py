"""Candidates: a table keyed by candidate id, and the selected candidate's streaming diff below."""

from __future__ import annotations

from typing import Any, Callable

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.color import Color
from textual.containers import Vertical
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from specpilot.app.state import CandidateView, DashboardState
from specpilot.app.widgets.diffview import DiffView

COLUMNS = (("cid", "cid", 5), ("agent", "agent", 12), ("title", "title", 24), ("state", "state", 10),
           ("gates", "gates", 5), ("pred", "pred", 5), ("meas", "meas", 5))
TITLE_MIN = 10
LEGEND = "pred, meas: speedup over the incumbent (meas: held-out, else tuning) · gates: ✓ pass ✗ fail · not run"


def speedup_cell(value: float | None) -> Text:
    """A speedup as everywhere on screen: 1.19x."""
    return Text("—" if value is None else f"{value:.2f}x", justify="right")


def short_cid(cid: str) -> str:
    """'3-r2-c4' -> 'c4': the run and round are in the header."""
    return cid.rsplit("-", 1)[-1] if "-r" in cid else cid


def state_label(state: str) -> str:
    """The state in at most 10 characters: 'failed heldout' -> '✗ heldout', 'agent failed' -> '✗ agent'."""
    if state.startswith("failed "):
        return "✗ " + state[len("failed "):]
    return {"agent failed": "✗ agent", "approved": "✓ approved", "passed": "✓ passed"}.get(state, state)


def fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


def badge(style: Style) -> Style:
    """A state's colour as the cell's background with black or white text on it, so the cell reads the
    same on the highlighted row as on any other, in every theme."""
    if style.color is None or style.color.triplet is None:
        return style
    back = Color(*style.color.triplet)
    return Style(color=back.get_contrast_text(1.0).rich_color, bgcolor=back.rich_color, bold=True,
                 underline=style.underline, strike=style.strike)


class CandidateTable(DataTable):
    """One row per candidate of the current round, keyed by cid; cells update in place."""

    BINDINGS = [Binding("enter", "select_cursor", "Diff")]  # the footer keeps saying what enter does

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
            self.add_column(label, key=key, width=self._title_width() if key == "title" else width)
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

    def _title_width(self) -> int:
        """What is left for titles once the other columns (and their padding) have their width."""
        others = sum(w for _, key, w in COLUMNS if key != "title") + 2 * self.cell_padding * len(COLUMNS)
        return max(TITLE_MIN, (self.size.width or self.app.size.width) - others - 2)

    def on_resize(self) -> None:
        if not self._ready:
            return
        width = self._title_width()
        column = self.columns.get("title")  # type: ignore[call-overload]
        if column is not None and column.width != width:
            column.width = width
            self.sync(restyle=True)

    def _row(self, cand: CandidateView) -> tuple[Text, ...]:
        state_style = badge(self.get_component_rich_style(self._state_style(cand)))
        title = cand.title or (f"no candidate: {cand.failure}" if cand.state == "agent failed" and cand.failure
                               else f"({cand.direction})" if cand.direction else "")
        agent_width = dict((k, w) for _, k, w in COLUMNS)["agent"]
        return (Text(short_cid(cand.cid)), Text(fit(cand.agent, agent_width)), Text(fit(title, self._title_width())),
                Text(state_label(cand.state), style=state_style), Text(cand.gate_marks), speedup_cell(cand.predicted),
                speedup_cell(cand.measured))

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
        view.placeholder = ("select a candidate to see its proposal" if self.state.candidates else
                            "no proposals yet: agents propose once the cost model has measured the incumbent")
        cand = self.state.candidates.get(self.selected_cid or "")
        if cand is None:
            view.show("")
        elif cand.state == "agent failed" and not cand.text:
            view.show(f"agent {cand.agent} failed: {cand.failure}")
        else:
            view.show(cand.text, follow=cand.state == "streaming")
        if restyle:
            view.restyle()
