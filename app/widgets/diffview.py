"""A scrolling view of a candidate's streamed text and diff, coloured line by line."""

from __future__ import annotations

from typing import Any, Mapping

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static


def line_kind(line: str) -> str:
    """add, del, hunk, meta or plain, from a unified-diff line's prefix."""
    if line.startswith(("+++", "---", "diff ", "index ")):
        return "meta"
    if line.startswith("@@"):
        return "hunk"
    if line.startswith("+"):
        return "add"
    if line.startswith("-"):
        return "del"
    if line.startswith("# "):
        return "meta"
    return "plain"


def diff_text(text: str, styles: Mapping[str, Style]) -> Text:
    """Rich text for `text` with each diff line styled by its kind."""
    out = Text()
    for line in text.splitlines(keepends=True):
        out.append(line, styles.get(line_kind(line), Style()))
    return out


class DiffView(VerticalScroll):
    """Shows one candidate's text; follows the end while it streams."""

    COMPONENT_CLASSES = {"diff--add", "diff--del", "diff--hunk", "diff--meta", "diff--empty"}

    def __init__(self, placeholder: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = ""
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        yield Static(id="diff-body")

    def on_mount(self) -> None:
        self._render_text()

    def show(self, text: str, follow: bool = False) -> None:
        """Replace the text (a no-op when unchanged); scroll to the end when `follow`."""
        if text == self.text and self.is_mounted:
            return
        self.text = text
        self._render_text()
        if follow:
            self.call_after_refresh(self.scroll_end, animate=False)

    def restyle(self) -> None:
        """Re-render after a theme change."""
        self._render_text()

    def _render_text(self) -> None:
        body = self.query("#diff-body")
        if not body:
            return
        if not self.text:
            body.first(Static).update(Text(self.placeholder, style=self.get_component_rich_style("diff--empty")))
            return
        styles = {k: self.get_component_rich_style(f"diff--{k}") for k in ("add", "del", "hunk", "meta")}
        body.first(Static).update(diff_text(self.text, styles))
