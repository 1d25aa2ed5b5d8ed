"""Token forcing: per candidate, how often its output left the stock reference, against the limit."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from specpilot.app.state import DashboardState, ForcingView
from specpilot.app.widgets.candidates import short_cid

COLUMNS = ("cid", "tokens", "mismatches", "rate", "near-ties", "threshold", "result")


def percent(value: float) -> str:
    """A rate given as a fraction, shown in percent."""
    return f"{value * 100:.2f}%"


def _count(value: int | None) -> str:
    """A count, or a dash where forcing could not score the outputs (its error is on the status line)."""
    return "—" if value is None else str(value)


class ForcingTable(DataTable):
    """One row per forced candidate: tokens, mismatches, rate, near-ties, threshold and PASS/FAIL."""

    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES | {"forcing--pass", "forcing--fail"}

    def __init__(self, state: DashboardState, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self.state = state
        self._ready = False

    def on_mount(self) -> None:
        for key in COLUMNS:
            self.add_column(key, key=key)
        self._ready = True
        self.sync()

    def _row(self, f: ForcingView) -> tuple[Text, ...]:
        verdict = Text("PASS" if f.passed else "FAIL",
                       style=self.get_component_rich_style("forcing--pass" if f.passed else "forcing--fail"))
        nums = (str(f.tokens), _count(f.mismatches), percent(f.rate), _count(f.near_ties), percent(f.threshold))
        return (Text(short_cid(f.cid)), *(Text(n, justify="right") for n in nums), verdict)

    def sync(self, restyle: bool = False) -> None:
        """Match the rows to the state's forcing results."""
        if not self._ready:
            return
        for key in [str(k.value) for k in self.rows if str(k.value) not in self.state.forcing]:
            self.remove_row(key)
        for cid, result in self.state.forcing.items():
            row = self._row(result)
            if cid not in self.rows:
                self.add_row(*row, key=cid)
                continue
            for key, cell in zip(COLUMNS, row):
                old = self.get_cell(cid, key)
                if restyle or not isinstance(old, Text) or old.plain != cell.plain:
                    self.update_cell(cid, key, cell)

    def verdicts(self) -> dict[str, str]:
        """cid -> PASS/FAIL as shown (for tests and the help text)."""
        return {str(k.value): self.get_cell(k, "result").plain for k in self.rows}
