"""specpilot-tui: the live dashboard of the SpecPilot loop (SpecPilotApp and the entry point)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from functools import partial
from typing import Callable, Sequence

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import get_current_worker

from specpilot.app.bridge import CoreEvent, LoopBridge, LoopEnded, StoreLike, build_handle, one_line, open_store
from specpilot.app.commands import SpecPilotCommands
from specpilot.app.screens.help import HelpScreen
from specpilot.app.screens.main import MainScreen
from specpilot.app.screens.reject import RejectScreen
from specpilot.app.screens.runs import RunsScreen
from specpilot.app.settings import load_settings, save_setting
from specpilot.app.widgets.dashboard import Dashboard
from specpilot.core.cli import db_path, loop_options
from specpilot.core.events import Event, LoopHandle, StateChanged
from specpilot.themes import DEFAULT_THEME, MONO_THEME, THEMES, VARIABLE_DEFAULTS

LIVE_ONLY = {"approve", "reject", "toggle_pause"}
QUIT_GRACE_S = 15.0  # how long quitting waits for the step in flight to stop before leaving anyway
SIGNALS = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def build_parser() -> argparse.ArgumentParser:
    """The options of `specpilot run` (core.cli.loop_options), plus the dashboard's own."""
    p = argparse.ArgumentParser(prog="specpilot-tui", description="Live dashboard of the SpecPilot loop.")
    loop_options(p)
    p.add_argument("--replay", nargs="?", const="", default=None, metavar="RUN",
                   help="replay a stored run instead of running the loop (no RUN: list the runs)")
    p.add_argument("--theme", metavar="NAME", help="theme: " + ", ".join(t.name for t in THEMES))
    return p


class SpecPilotApp(App[int]):
    """The dashboard. Live events arrive as CoreEvent messages; replay screens read the store."""

    CSS_PATH = "app.tcss"
    TITLE = "SpecPilot"
    COMMANDS = App.COMMANDS | {SpecPilotCommands}
    BINDINGS = [
        Binding("a", "approve", "Approve"),
        Binding("r", "reject", "Reject"),
        Binding("space", "toggle_pause", "Pause"),
        Binding("enter", "full_diff", "Diff"),
        Binding("R", "runs", "Runs"),
        Binding("t", "cycle_theme", "Theme"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, args: argparse.Namespace | None = None, *,
                 loop_factory: Callable[[], LoopHandle] | None = None,
                 store_opener: Callable[[], StoreLike] | None = None) -> None:
        super().__init__()
        self.args = args or build_parser().parse_args([])
        self.loop_factory = loop_factory
        self.store_opener = store_opener or partial(open_store, db_path(self.args))
        self.bridge: LoopBridge | None = None
        self._startup_theme: str | None = None
        self._exiting: int | None = None  # the exit status, once quitting has begun
        self._hung_up = False  # SIGHUP: the terminal is gone, so there is no screen to restore
        for theme in THEMES:
            self.register_theme(theme)

    def get_default_screen(self) -> Screen:
        return MainScreen()

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(VARIABLE_DEFAULTS)

    @property
    def live(self) -> Dashboard:
        """The live dashboard (on the main screen, whatever screen is on top)."""
        return next(s for s in self.screen_stack if isinstance(s, MainScreen)).dashboard

    def on_mount(self) -> None:
        self.theme = self._initial_theme()
        self._startup_theme = self.theme if not self.args.theme else None
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        loop = asyncio.get_running_loop()
        for signum, name in SIGNALS.items():
            try:
                loop.add_signal_handler(signum, self._begin_exit, f"interrupted ({name})", 128 + signum)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread, or no signals here: the default handling stays
        if self.loop_factory is not None:
            self.bridge = LoopBridge(self.loop_factory, self.post_message)
            self._run_loop()

    def on_ready(self) -> None:
        if self.args.replay is not None:
            self.open_runs(self.args.replay or None)

    def _initial_theme(self) -> str:
        """--theme, else the remembered theme, else monochrome under NO_COLOR, else dark."""
        wanted = self.args.theme or load_settings().get("theme")
        if wanted and wanted in self.available_themes:
            return wanted
        if self.args.theme:
            names = ", ".join(t.name for t in THEMES)
            self.live.report(f"unknown theme {self.args.theme!r}; themes: {names}", "notice")
            self.args.theme = None
        return MONO_THEME if os.environ.get("NO_COLOR") else DEFAULT_THEME

    def _remember_theme(self, theme: object) -> None:
        """Save a chosen theme (--theme, t, the palette), not the default applied at startup."""
        if self.theme == self._startup_theme:
            return
        self._startup_theme = None
        error = save_setting("theme", self.theme)
        if error:
            self.notify(error, severity="warning")

    @work(thread=True, exclusive=True, group="loop", exit_on_error=False)
    def _run_loop(self) -> None:
        """The loop, in a thread; its events come back as CoreEvent messages."""
        worker = get_current_worker()
        assert self.bridge is not None
        self.bridge.run(lambda: worker.is_cancelled)

    def on_core_event(self, message: CoreEvent) -> None:
        self.live.feed(message.event)

    def on_loop_ended(self, message: LoopEnded) -> None:
        """A loop that raised: report it, unless its own `error` event already did."""
        if self._exiting is not None or not any(isinstance(s, MainScreen) for s in self.screen_stack):
            self._leave(self._exiting or 0)  # quitting (or already torn down): nothing left to show
            return
        live = self.live
        if message.error and live.state.loop_state != "failed":
            live.feed(Event.of(StateChanged("failed")))
            live.report(message.error)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.action_applies(action, self.screen)

    def action_applies(self, action: str, screen: Screen) -> bool:
        """Whether `action` makes sense on `screen` (hidden from the footer and palette otherwise)."""
        if action in LIVE_ONLY:
            return isinstance(screen, MainScreen)
        if action == "full_diff":
            return bool(screen.query(Dashboard))
        if action == "runs":
            return not isinstance(screen, RunsScreen)
        return True

    def action_approve(self) -> None:
        self._decide(self.live.current_cid, "approve", "")

    def action_reject(self) -> None:
        live = self.live
        cid = live.current_cid
        refusal = live.state.refusal(cid, "reject")
        if refusal or cid is None:
            self.notify(refusal or "no candidate selected", title="Refused", severity="warning")
            return

        def send(note: str | None) -> None:
            if note is not None:
                self._decide(cid, "reject", note)

        self.push_screen(RejectScreen(cid, live.state.candidates[cid].title), send)

    def _decide(self, cid: str | None, decision: str, note: str) -> None:
        """Check the decision against the dashboard's state, then send it; notify either way."""
        refusal = self.live.state.refusal(cid, decision)
        if refusal is None:
            refusal = self.bridge.decide(str(cid), decision, note) if self.bridge else "no live loop to decide in"
        if refusal:
            self.notify(refusal, title="Refused", severity="warning")
        else:
            self.notify(f"{'approved' if decision == 'approve' else 'rejected'} {cid}", title="Decision sent")

    def action_toggle_pause(self) -> None:
        if self.bridge is None:
            self.notify("no live loop to pause", severity="warning")
            return
        error = self.bridge.toggle_pause()
        if error:
            self.notify(error, severity="warning")
        else:
            self.notify("pausing after the step in flight" if self.bridge.paused else "resumed")

    def action_full_diff(self) -> None:
        dashboards = self.screen.query(Dashboard)
        if dashboards:
            dashboards.first().open_diff()

    def action_runs(self) -> None:
        self.open_runs(None)

    def open_runs(self, run: str | None) -> None:
        """The runs screen (and, for `run`, straight into its last round's replay)."""
        if run is None and any(isinstance(s, RunsScreen) for s in self.screen_stack):
            while not isinstance(self.screen, RunsScreen):
                self.pop_screen()
            return
        try:
            store = self.store_opener()
        except Exception as exc:
            self.notify(one_line(exc), title="Runs", severity="error", timeout=10)
            return
        runs = RunsScreen(store, db_path(self.args))
        self.push_screen(runs)
        if run is not None:
            self.call_after_refresh(runs.open, run, None)

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """Save an SVG of the screen: to ~/Downloads when it exists, else the working directory; say where."""
        downloads = os.path.expanduser("~/Downloads")
        folder = path or (downloads if os.path.isdir(downloads) else os.getcwd())
        try:
            saved = self.save_screenshot(filename, folder)
        except OSError as exc:
            self.notify(f"screenshot not saved in {folder}: {exc.strerror or exc}", title="Screenshot",
                        severity="error")
            return
        self.notify(f"saved {saved}", title="Screenshot")

    def action_cycle_theme(self) -> None:
        names = [t.name for t in THEMES]
        nxt = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self.theme = nxt
        self.notify(f"theme: {nxt}", timeout=2)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self._begin_exit("quit", 1 if self.live.state.loop_state == "failed" else 0)

    def _begin_exit(self, why: str, code: int) -> None:
        """Leave: at once when no loop runs; else stop the step in flight (its workers are killed), say
        what is being waited for, and exit when the loop has ended (or after QUIT_GRACE_S). Asked twice,
        leave now."""
        self._hung_up = self._hung_up or why.endswith("(SIGHUP)")
        if self._exiting is not None or self.bridge is None or not self.bridge.running:
            self._leave(code if self._exiting is None else self._exiting)
            return
        self._exiting = code
        waiting = self.bridge.waiting_for
        self.bridge.abort(why)
        self.live.state.quitting = waiting
        self.live.report(f"quitting: stopping {waiting} (workers are killed); q again to leave at once", "notice")
        self.set_timer(QUIT_GRACE_S, lambda: self._leave(self._exiting or 0))

    def _leave(self, code: int) -> None:
        """Exit with `code`. After a hang-up there is no terminal to restore (Textual's driver would wait on
        it for ever), so once the loop has closed its run the process ends at once, its workers killed."""
        if not self._hung_up:
            self.exit(return_code=code)
            return
        if self.bridge is not None:
            self.bridge.kill_workers()
        sys.stderr.flush()
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of specpilot-tui; returns the exit status (0 after `q`)."""
    args = build_parser().parse_args(argv)
    factory = None if args.replay is not None else partial(build_handle, args)
    app = SpecPilotApp(args, loop_factory=factory)
    app.run()
    code = app.return_code or 0
    if app.bridge is not None and not app.bridge.join(2.0):  # the app already waited QUIT_GRACE_S for it
        failed = app.bridge.close_abandoned()
        if failed:
            print(f"specpilot-tui: could not record the run's end ({failed}); it will read as interrupted",
                  file=sys.stderr)
        print(f"specpilot-tui: the loop did not stop in time ({app.bridge.waiting_for}); "
              f"killed {app.bridge.kill_workers()} worker(s) and left", file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
