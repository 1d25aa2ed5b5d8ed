"""Glue between the core and the UI: loop events become Textual messages, user decisions go back.

The core never imports Textual. The loop runs in a thread worker; every event it emits is posted to
the app as a `CoreEvent` (post_message is thread-safe and does not block). Decisions, pause, resume
and stop are plain calls on the `LoopHandle`; their failures come back as one-line messages.
"""

from __future__ import annotations

import importlib
import os
import threading
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable, Protocol

from textual.message import Message

from specpilot.core.events import DecisionRefused, Event, LoopHandle

LOOP_FACTORY_ENV = "SPECPILOT_LOOP_FACTORY"
"""`MODULE:CALLABLE`, importable: when set, the app drives what that callable returns (a LoopHandle) instead of
core.loop. The tmux tests name their scripted core with it (tests/ on PYTHONPATH); the package ships none."""


class CoreEvent(Message):
    """One event from the loop, posted from the worker thread."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class LoopEnded(Message):
    """The loop returned (error is None) or raised (error is its one-line message)."""

    def __init__(self, error: str | None) -> None:
        super().__init__()
        self.error = error


class LoopUnavailable(Exception):
    """The live loop cannot be built; the message is one line, fit for the status line."""


class StoreUnavailable(Exception):
    """The store cannot be opened or read; the message is one line."""


class StoreLike(Protocol):
    """The read side of core.store.db.Store that the replay screens use."""

    def list_runs(self) -> list[dict[str, Any]]: ...

    def list_rounds(self, run_id: Any) -> list[dict[str, Any]]: ...

    def events(self, run_id: Any, upto_round: int | None = None) -> list[Event]: ...


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line, or its type when it has none."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def build_handle(args: Namespace) -> LoopHandle:
    """The live loop for the parsed options (imported lazily); raises LoopUnavailable."""
    if os.environ.get(LOOP_FACTORY_ENV):
        return _named_loop(os.environ[LOOP_FACTORY_ENV])
    try:
        from specpilot.core.loop import build_loop
    except Exception as exc:
        raise LoopUnavailable(f"the live loop is not available ({one_line(exc)}); "
                              "replaying stored runs still works (R)") from None
    try:
        return build_loop(args)
    except Exception as exc:
        raise LoopUnavailable(f"cannot start the loop: {one_line(exc)}") from None


def _named_loop(spec: str) -> LoopHandle:
    """The LoopHandle `MODULE:CALLABLE` returns (see LOOP_FACTORY_ENV); raises LoopUnavailable in one line."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise LoopUnavailable(f"{LOOP_FACTORY_ENV}={spec!r} names nothing importable ({one_line(exc)}); "
                              "give MODULE:CALLABLE") from None
    return factory()


def open_store(path: str | os.PathLike[str]) -> StoreLike:
    """Open the store for reading runs; raises StoreUnavailable with a one-line reason."""
    if not Path(path).is_file():
        raise StoreUnavailable(f"no store at {path} (run the loop first, or pass --db)")
    try:
        from specpilot.core.store.db import Store, StoreError
    except Exception as exc:
        raise StoreUnavailable(f"the store is not available ({one_line(exc)})") from None
    try:
        return Store(path)
    except StoreError as exc:
        raise StoreUnavailable(one_line(exc)) from None
    except Exception as exc:
        raise StoreUnavailable(f"cannot open {path}: {one_line(exc)}") from None


class LoopBridge:
    """Runs a LoopHandle for the app and relays the user's decisions to it."""

    def __init__(self, factory: Callable[[], LoopHandle], post: Callable[[Message], Any]) -> None:
        self.factory = factory
        self.post = post
        self.handle: LoopHandle | None = None
        self.paused = False
        self.running = False
        self.thread: threading.Thread | None = None

    def emit(self, event: Event) -> None:
        """The loop's emit callback: hand the event to the UI thread."""
        self.post(CoreEvent(event))

    def run(self, cancelled: Callable[[], bool]) -> None:
        """Build and run the loop; called in the thread worker, returns when it ends or is cancelled.

        The loop itself runs in a daemon thread so quitting never waits for a step in flight.
        """
        outcome: list[str | None] = []

        def target() -> None:
            try:
                self.handle = self.factory()
                self.running = True
                self.handle.run(self.emit)
                outcome.append(None)
            except LoopUnavailable as exc:
                outcome.append(str(exc))
            except BaseException as exc:
                outcome.append(f"the loop stopped with an error: {type(exc).__name__}: {one_line(exc)}")
            finally:
                self.running = False

        thread = self.thread = threading.Thread(target=target, name="specpilot-loop", daemon=True)
        thread.start()
        while thread.is_alive():
            if cancelled():
                self.stop()
                return
            thread.join(0.1)
        self.post(LoopEnded(outcome[0] if outcome else None))

    def decide(self, cid: str, decision: str, note: str = "") -> str | None:
        """Send a decision; return why it was refused or failed, None when accepted."""
        if self.handle is None or not self.running:
            return "the loop is not running"
        try:
            self.handle.decide(cid, decision, note)
        except DecisionRefused as exc:
            return one_line(exc)
        except Exception as exc:
            return f"{decision} {cid} failed: {one_line(exc)}"
        return None

    def toggle_pause(self) -> str | None:
        """Pause or resume; return an error message or None."""
        if self.handle is None or not self.running:
            return "the loop is not running"
        try:
            if self.paused:
                self.handle.resume()
            else:
                self.handle.pause()
        except Exception as exc:
            return f"{'resume' if self.paused else 'pause'} failed: {one_line(exc)}"
        self.paused = not self.paused
        return None

    def stop(self) -> None:
        """Ask the loop to end at its next step boundary (never raises)."""
        if self.handle is not None:
            try:
                self.handle.stop()
            except Exception:
                pass

    def abort(self, why: str = "quit") -> None:
        """Ask the loop to abandon the step in flight and end now (a handle without abort just stops)."""
        if self.handle is None:
            return
        try:
            abort = getattr(self.handle, "abort", None)
            if abort is not None:
                abort(why)
            self.handle.stop()
        except Exception:
            pass

    @property
    def waiting_for(self) -> str:
        """What the loop is busy with, in words, for the quitting message."""
        return str(getattr(self.handle, "waiting_for", "") or "the step in flight")

    def close_abandoned(self) -> str | None:
        """The process leaves with the loop still in its step: have the loop record its run's end now (a
        handle without it leaves the run to read as interrupted). Returns why that failed, else None."""
        close = getattr(self.handle, "close_abandoned", None)
        if close is None:
            return None
        try:
            close()
        except Exception as exc:
            return one_line(exc)
        return None

    def kill_workers(self) -> int:
        """Kill the loop's workers through its control API (the process is leaving without waiting for the
        step in flight); returns how many there were, 0 for a handle without workers."""
        kill = getattr(self.handle, "kill_workers", None)
        return int(kill()) if kill is not None else 0

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the loop thread; True when it has ended."""
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True
