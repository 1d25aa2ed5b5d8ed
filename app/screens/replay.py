"""Replay: a stored round rendered by the live dashboard, and its event log re-played at a speed."""

from __future__ import annotations

import asyncio
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from specpilot.app.bridge import StoreLike, one_line
from specpilot.app.widgets.dashboard import Dashboard
from specpilot.core.events import Event, MalformedEvent

SPEEDS: tuple[tuple[str, float | None], ...] = (("1x", 1.0), ("10x", 10.0), ("100x", 100.0), ("instant", None))
MAX_WAIT_S = 2.0
"""Longest pause between two replayed events, whatever the recorded gap."""


def split_round(events: list[Event], index: int | None) -> tuple[list[Event], list[Event]]:
    """Events before round `index` started, and the round's own events (all events when None)."""
    if index is None:
        return [], list(events)
    for i, event in enumerate(events):
        if event.kind == "round_started" and _round(event) == index:
            return list(events[:i]), list(events[i:])
    return [], list(events)


def _round(event: Event) -> int | None:
    """A round_started event's round; None when the stored event does not parse (it is shown as a notice)."""
    try:
        return event.body.round  # type: ignore[attr-defined]
    except MalformedEvent:
        return None


class ReplayScreen(Screen[None]):
    """The dashboard for one stored round; `p` re-plays the round's events through the live handlers."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("p", "play", "Play"),
        Binding("1", "speed(0)", "1x", show=False),
        Binding("2", "speed(1)", "10x", show=False),
        Binding("3", "speed(2)", "100x", show=False),
        Binding("4", "speed(3)", "Instant", show=False),
        Binding("left_square_bracket", "round(-1)", "Prev"),
        Binding("right_square_bracket", "round(1)", "Next"),
    ]

    def __init__(self, store: StoreLike, run_id: Any, rounds: list[int], index: int | None) -> None:
        super().__init__()
        self.store = store
        self.run_id = run_id
        self.rounds = list(rounds)
        self.index = index
        self.speed = 1
        self.events: list[Event] = []
        self.playing = False

    def compose(self) -> ComposeResult:
        yield Static(id="replay-bar")
        yield Dashboard(id="replay")
        yield Footer(compact=True)

    @property
    def dashboard(self) -> Dashboard:
        return self.query_one(Dashboard)

    def on_mount(self) -> None:
        self.show_round()

    def show_round(self) -> None:
        """Render the panels as they were at the end of the round."""
        self.workers.cancel_group(self, "replay")
        self.playing = False
        try:
            self.events = list(self.store.events(self.run_id, upto_round=self.index))
        except Exception as exc:
            self.events = []
            self.dashboard.load([])
            self.dashboard.report(f"cannot read events of run {self.run_id}: {one_line(exc)}")
        else:
            self.dashboard.load(self.events)
        self.update_bar()

    def update_bar(self, position: str | None = None) -> None:
        where = f"round {self.index}" if self.index is not None else "all events"
        if position is None:
            position = "playing" if self.playing else f"end of {where}"
        name = SPEEDS[self.speed][0]
        own = len(split_round(self.events, self.index)[1])  # what `p` plays: the round's own events
        self.query_one("#replay-bar", Static).update(
            f" REPLAY · run {self.run_id} · {where} · {own} events · speed {name} · {position}")

    def action_play(self) -> None:
        prefix, events = split_round(self.events, self.index)
        self.playing = True
        self.update_bar()
        self._play(prefix, events, SPEEDS[self.speed][1])

    @work(exclusive=True, group="replay")
    async def _play(self, prefix: list[Event], events: list[Event], speed: float | None) -> None:
        """Feed the round's events to the dashboard at `speed` times their recorded pace."""
        dashboard = self.dashboard
        dashboard.load(prefix)
        last = events[0].time if events else 0.0
        for n, event in enumerate(events):
            if speed is not None:
                wait = min(max(event.time - last, 0.0) / speed, MAX_WAIT_S)
                if wait > 0:
                    await asyncio.sleep(wait)
            last = event.time
            dashboard.feed(event)
            if n % 50 == 0 or n + 1 == len(events):
                self.update_bar(f"playing {n + 1}/{len(events)}")
        dashboard.drain()
        self.playing = False
        self.update_bar(f"played {len(events)}/{len(events)}")

    def action_speed(self, which: int) -> None:
        self.speed = which
        self.update_bar()

    def action_round(self, step: int) -> None:
        if self.index is None or self.index not in self.rounds:
            return
        pos = self.rounds.index(self.index) + step
        if 0 <= pos < len(self.rounds):
            self.index = self.rounds[pos]
            self.show_round()
        else:
            edge = "last" if step > 0 else "first"
            self.app.notify(f"round {self.index} is the {edge} round of run {self.run_id}", timeout=3)

    def action_back(self) -> None:
        self.workers.cancel_group(self, "replay")
        self.app.pop_screen()
