"""Speedup across rounds: the incumbent's held-out speedup over AR, with stock and the ceiling."""

from __future__ import annotations

from typing import Any

from textual_plotext import PlotextPlot

from app.state import DashboardState

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
            plt.title("no incumbent yet")
            self.refresh()
            return
        plt.title("")
        mono = self.app.theme.endswith("-mono")
        for name, (xs, ys) in self.series.items():
            marker, color = STYLES[name]
            plt.plot(xs, ys, label=name, marker=marker, color="white" if mono else color)
        xs, ys = self.series["incumbent"]
        plt.scatter(xs, ys, marker="●", color="white" if mono else STYLES["incumbent"][1])
        rounds = sorted({int(x) for x in self.series["incumbent"][0]} | {0})
        plt.xticks(rounds)
        top = max(max(ys) for _, ys in self.series.values())
        plt.ylim(0, top * 1.15)
        self.refresh()
