"""A modal with one candidate's full proposal: rationale, diff, gates and forcing."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen

from specpilot.app.state import CandidateView, ForcingView
from specpilot.app.widgets.diffview import DiffView
from specpilot.app.widgets.forcing import percent
from specpilot.core.events import GATES


def summary(cand: CandidateView, forcing: ForcingView | None) -> str:
    """Plain lines describing the candidate's gates, speedups and forcing result."""
    lines = [f"{cand.cid} · {cand.agent or '?'} · {cand.kind or 'diff'} · {cand.state}"]
    for gate in GATES:
        if gate in cand.gates:
            mark = "✓" if cand.gates[gate] else "✗"
            detail = cand.gate_details.get(gate, "")
            lines.append(f"  {mark} {gate}" + (f": {detail}" if detail else ""))
    for split, value in cand.speedups.items():
        lines.append(f"  {split} speedup {value:.2f}x")
    if forcing is not None:
        lines.append(f"  forcing {forcing.mismatches}/{forcing.tokens} = {percent(forcing.rate)} "
                     f"(limit {percent(forcing.threshold)}) {'PASS' if forcing.passed else 'FAIL'}")
    if cand.failure:
        lines.append(f"  agent failed: {cand.failure}")
    if cand.decision:
        lines.append(f"  decision: {cand.decision}" + (f" ({cand.note})" if cand.note else ""))
    return "\n".join(lines)


class DiffScreen(ModalScreen[None]):
    """Full diff of one candidate; escape or enter closes it."""

    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("enter", "dismiss", "Close", show=False)]

    def __init__(self, cand: CandidateView, forcing: ForcingView | None = None) -> None:
        super().__init__()
        self.cand = cand
        self.forcing = forcing

    def compose(self) -> ComposeResult:
        with Vertical(id="diff-dialog") as box:
            box.border_title = self.cand.title or self.cand.cid
            box.border_subtitle = "escape to close"
            yield DiffView(id="full-diff")

    def on_mount(self) -> None:
        view = self.query_one(DiffView)
        view.show(summary(self.cand, self.forcing) + "\n\n" + (self.cand.text or "(no text yet)"))
        view.focus()

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
