"""The header line (deployment, round, loop state, best speedup) and the status line (last message)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from specpilot.app.state import DashboardState, model_names
from specpilot.core.progress import describe

SEVERITY_MARK = {"information": "•", "warning": "!", "error": "✗"}


class StatusHeader(Static):
    """SpecPilot │ target → drafter · numerics │ round N │ state │ best X.XXx over AR.

    The deployment's numerics (a run stored before numerics existed is f32) is always shown when the header is
    wide; on a narrow one only when it is not the default f32, so the best speedup keeps its room."""

    COMPONENT_CLASSES = {"header--title", "header--dim", "header--state", "header--alert", "header--best"}

    def __init__(self, state: DashboardState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state
        self.text = ""

    def on_mount(self) -> None:
        self.sync()

    def on_resize(self) -> None:
        self.sync()

    def sync(self, restyle: bool = False) -> None:
        s = self.state
        style = self.get_component_rich_style
        sep = (" │ ", style("header--dim"))
        dep = s.deployment
        deployment = model_names(dep) if dep else "no run"
        alert = s.loop_state in ("paused", "failed", "awaiting_approval")
        wide = self.size.width >= 100 or not self.size.width
        parts: list[tuple[str, object]] = [(" ", "")]
        if wide:
            parts += [("SpecPilot", style("header--title")), sep]
        parts.append((deployment, ""))
        numerics = (dep.get("numerics") or "f32") if dep else None
        if numerics and (wide or numerics != "f32"):
            parts.append((f" · {numerics}", ""))
        if s.run is not None:
            parts += [sep, (f"run {s.run}", "")]
        parts += [sep, (f"round {s.round}" if s.round is not None else "round —", ""), sep,
                  (s.loop_state.replace("_", " ").upper() if alert else s.loop_state,
                   style("header--alert" if alert else "header--state"))]
        best = s.best_speedup
        parts += [sep, (f"best {best:.2f}x vs AR" if best is not None else "best —", style("header--best"))]
        if s.auto:
            parts += [sep, ("auto", style("header--dim"))]
        text = Text.assemble(*parts, no_wrap=True, overflow="ellipsis")
        self.text = text.plain
        self.update(text)


class StatusLine(Static):
    """The last notice or error, so messages stay visible after their notification fades."""

    COMPONENT_CLASSES = {"status--information", "status--warning", "status--error"}

    def __init__(self, state: DashboardState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state
        self.text = ""

    def on_mount(self) -> None:
        self.sync()

    def sync(self, restyle: bool = False) -> None:
        step = self.state.current_progress()
        if step is not None and self.state.quitting is None:
            text = Text(f" ⏳ {self.state.loop_state}: {describe(step)}",
                        style=self.get_component_rich_style("status--information"), no_wrap=True, overflow="ellipsis")
            self.text = text.plain
            self.update(text)
            return
        alert = self.state.status
        if alert is None:
            self.text = ""
            self.update("")
            return
        mark = SEVERITY_MARK.get(alert.severity, "•")
        text = Text(f" {mark} {alert.message}", style=self.get_component_rich_style(f"status--{alert.severity}"),
                    no_wrap=True, overflow="ellipsis")
        self.text = text.plain
        self.update(text)
