"""The step loop's inbox: adds and aborts from the event loop, and the count of requests waiting.

Admission is one locked check-and-append, so a burst of concurrent requests cannot pass `max_waiting`
(the count used to rise only after an await). A request counts as waiting from the moment it is
admitted until the scheduler runs it: first in the inbox, then in the scheduler's queue.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from mixserve.engine.streams import EngineBusyError, Tracked


class Inbox:
    """Thread-safe: the event loop puts, the step thread pops between steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self.pending_adds = 0  # in the inbox, not yet handed to the engine
        self._scheduler_waiting = 0  # from the last stats snapshot, plus adds handed over since

    @property
    def num_waiting(self) -> int:
        return self.pending_adds + self._scheduler_waiting

    def add(self, tracked: Tracked, max_waiting: int | None = None) -> None:
        """Queue an add; EngineBusyError if `max_waiting` requests are waiting already."""
        with self._lock:
            waiting = self.pending_adds + self._scheduler_waiting
            if max_waiting is not None and waiting >= max_waiting:
                raise EngineBusyError(f"{waiting} requests are waiting already (the limit is {max_waiting})")
            self.pending_adds += 1
            self._items.append(("add", tracked))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._items.append(("abort", request_id))

    def pop(self) -> tuple[str, Any] | None:
        """The oldest item, or None; an add moves from one count of waiting to the other, never dipping."""
        with self._lock:
            if not self._items:
                return None
            kind, item = self._items.popleft()
            if kind == "add":
                self.pending_adds -= 1
                self._scheduler_waiting += 1
            return kind, item

    def take_adds(self) -> list[Tracked]:
        """Empty the inbox; the adds it held (their requests never reached the engine)."""
        with self._lock:
            pending = [item for kind, item in self._items if kind == "add"]
            self._items.clear()
            self.pending_adds = 0
        return pending

    def set_scheduler_waiting(self, n: int) -> int:
        """The scheduler's own count after a step; returns the adds still pending."""
        with self._lock:
            self._scheduler_waiting = n
            return self.pending_adds
