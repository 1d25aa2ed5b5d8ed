"""A modal that asks for an optional note before rejecting a candidate."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class RejectScreen(ModalScreen[str | None]):
    """Dismisses with the note (possibly empty) on enter, or None on escape."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, cid: str, title: str = "") -> None:
        super().__init__()
        self.cid = cid
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="reject-dialog") as box:
            box.border_title = f"Reject {self.cid}"
            yield Label(self.title_text or self.cid, id="reject-title", markup=False)
            yield Input(placeholder="note (optional), enter to reject", id="reject-note")
            with Horizontal(id="reject-buttons"):
                yield Button("Reject", variant="error", id="reject-ok")
                yield Button("Cancel", id="reject-cancel")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "reject-ok":
            self.dismiss(self.query_one(Input).value.strip())
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
