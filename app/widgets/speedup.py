"""Speedup across rounds: the incumbent's held-out speedup over AR, with stock and the ceiling."""

from __future__ import annotations

from typing import Any

from textual_plotext import PlotextPlot

from specpilot.app.state import DashboardState

Series = dict[str, tuple[list[float], list[float]]]


def speedup_series(state: DashboardState) -> Series:
    """incumbent per round; stock and ceiling as flat references at their latest values, from round 0."""
    points = state.incumbents
    if not points:
        return {}
    rounds = [float(p.round) for p in points]
    span = [0.0, max(rounds)] if max(rounds) > 0 else [0.0, 1.0]
    series: Series = {"incumbent": (rounds, [p.vs_ar for p in points])}
    stock = next((p.stock_vs_ar for p in reversed(points) if p.stock_vs_ar is not None), None)
    ceiling = next((p.ceiling for p in reversed(points) if p.ceiling is not None), None)
    if stock is not None:
        series["stock"] = (span, [stock, stock])
    if ceiling is not None:
        series["ceiling"] = (span, [ceiling, ceiling])
    return series


CEILING_ON_SCALE = 2.0  # a ceiling further above the data than this is named in the title, not drawn
STYLES = {"incumbent": ("braille", "green"), "stock": ("·", "orange"), "ceiling": ("=", "cyan")}


class SpeedupPlot(PlotextPlot):
    """A plotext chart of `speedup_series`, redrawn whenever an incumbent arrives."""

    def __init__(self, state: DashboardState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state
        self.series: Series = {}
        self._ready = False

    def on_mount(self) -> None:
        self._ready = True
        self.sync()

    def sync(self, restyle: bool = False) -> None:
        if not self._ready:
            return
        self.series = speedup_series(self.state)
        plt = self.plt
        plt.clear_data()
        plt.xlabel("round")
        if not self.series:
            plt.title("no incumbent yet: each finished round adds a point")
            self.refresh()
            return
        mono = self.app.theme.endswith("-mono")
        shown = {k: v for k, v in self.series.items() if k != "ceiling"}
        data = [y for _, ys in shown.values() for y in ys]
        low, top = min(data), max(data)
        ceiling = self.series.get("ceiling")
        on_scale = ceiling is not None and ceiling[1][0] <= top * CEILING_ON_SCALE
        if on_scale:
            shown["ceiling"] = ceiling
            top = max(top, ceiling[1][0])
        plt.title("" if ceiling is None or on_scale else
                  f"ceiling {ceiling[1][0]:.1f}x vs AR: off this scale, {ceiling[1][0] / max(data):.0f}x the best")
        for name, (xs, ys) in shown.items():
            marker, color = STYLES[name]
            label = f"{name} {ys[-1]:.2f}x" if name != "incumbent" else name
            plt.plot(xs, ys, label=label, marker=marker, color="white" if mono else color)
        xs, ys = self.series["incumbent"]
        plt.scatter(xs, ys, marker="●", color="white" if mono else STYLES["incumbent"][1])
        rounds = sorted({int(x) for x in self.series["incumbent"][0]} | {0})
        plt.xticks(rounds)
        pad = max(0.05, (top - low) * 0.15)
        # scaled to the data (the incumbent never sits on the floor), with headroom for the legend
        plt.ylim(max(0.0, low - pad), top + 4 * pad)
        self.refresh()
