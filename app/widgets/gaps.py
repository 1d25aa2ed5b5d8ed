"""Gap breakdown: where the time per output token goes, as horizontal bars."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from specpilot.app.state import DashboardState, GapView

EIGHTHS = " ▏▎▍▌▋▊▉"
LARGEST_MARK = " ◀ largest"
# a negative component: that part of the step ran faster than the cost model's floor for it (the step read
# its bytes faster than the probe's measured bandwidth), which a bar cannot show
BELOW_FLOOR = "◁ under its modelled floor"


def bar(value: float, scale: float, width: int) -> str:
    """A bar of `value/scale * width` cells, with eighth-cell precision."""
    if scale <= 0 or width <= 0:
        return ""
    eighths = round(max(0.0, min(value / scale, 1.0)) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + (EIGHTHS[part] if part else "")


def gap_title(view: GapView | None) -> str:
    """The panel title: measured and ceiling throughput."""
    if view is None:
        return "Gap breakdown"
    return (f"Gap breakdown · {view.measured_tokens_per_s:.1f} tok/s measured · "
            f"ceiling {view.ceiling_tokens_per_s:.1f} tok/s")


class GapBars(Widget):
    """One bar per cost-model component in ms per output token; the largest gap is highlighted."""

    COMPONENT_CLASSES = {"gaps--label", "gaps--bar", "gaps--largest", "gaps--value", "gaps--empty", "gaps--drift"}

    def __init__(self, state: DashboardState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state

    @property
    def view(self) -> GapView | None:
        return self.state.gaps

    @property
    def bars(self) -> list[tuple[str, float]]:
        """The (component, ms per token) pairs shown, in the order received."""
        return list(self.view.gaps) if self.view else []

    @property
    def largest(self) -> str | None:
        return self.view.largest if self.view else None

    def sync(self) -> None:
        """Redraw from the state."""
        self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.bars) + bool(self.drift))

    @property
    def drift(self) -> str:
        """Under numerics other than f32, the line saying how far its plain decoding is from transformers
        float32 (shown under the bars); empty under f32."""
        return self.view.drift if self.view else ""

    def render(self) -> Text:
        view = self.view
        if view is None or not view.gaps:
            return Text("waiting for the cost model…", style=self.get_component_rich_style("gaps--empty"))
        width = max(self.content_size.width, 20)
        label_w = min(max(len(name) for name, _ in view.gaps), 18)
        values = [f"{ms:6.2f} ms/tok" for _, ms in view.gaps]
        value_w = max(len(v) for v in values)
        bar_w = max(width - label_w - value_w - len(LARGEST_MARK) - 2, 4)
        scale = max(ms for _, ms in view.gaps)
        styles = {k: self.get_component_rich_style(f"gaps--{k}") for k in ("label", "bar", "largest", "value")}
        out = Text(no_wrap=True, overflow="crop")
        for i, ((name, ms), value) in enumerate(zip(view.gaps, values)):
            top = name == view.largest
            if i:
                out.append("\n")
            out.append(f"{name[:label_w]:<{label_w}} ", styles["largest"] if top else styles["label"])
            drawn = bar(ms, scale, bar_w) if ms >= 0 else BELOW_FLOOR[:bar_w]
            out.append(f"{drawn:<{bar_w}} ", styles["largest"] if top else styles["value" if ms < 0 else "bar"])
            out.append(f"{value:>{value_w}}", styles["largest"] if top else styles["value"])
            if top:
                out.append(LARGEST_MARK, styles["largest"])
        if view.drift:
            out.append("\n" + view.drift, self.get_component_rich_style("gaps--drift"))
        return out
