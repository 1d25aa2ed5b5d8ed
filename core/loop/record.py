"""Event persistence: every event of a run is stored first, then handed to whoever watches."""

from __future__ import annotations

import threading
from typing import Any

from specpilot.core.events import Emit, Event, EventBody


class EventLog:
    """A run's events in one order whichever thread emits (agents stream from their own threads): stored
    order is emitted order, and what watchers get is the stored copy (seq set, secrets redacted)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.run_id: int | None = None
        self.round = 0
        self.emit_to: Emit | None = None
        self.lock = threading.RLock()  # held across a round's closing transaction, so nothing interleaves

    def __call__(self, body: EventBody) -> None:
        """Store `body` as the run's next event and pass it on; nothing is recorded before the run exists."""
        if self.run_id is None:
            return
        with self.lock:
            stored = self.store.append_event(self.run_id, Event.of(body, self.run_id, self.round or None))
            if self.emit_to is not None:
                self.emit_to(stored)
