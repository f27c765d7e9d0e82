"""How a request's updates travel from the step thread to the event loop that waits for them.

The step thread owns the engine; each request's updates go to its own asyncio.Queue through the queue's
event loop (`call_soon_threadsafe`), batched so that one step wakes each loop once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class EngineDeadError(RuntimeError):
    """The step loop died, was restarted under this request, or was stopped: the request cannot go on."""


class RequestFailedError(RuntimeError):
    """The engine refused or dropped one request; the others carry on."""


class EngineBusyError(RuntimeError):
    """Too many requests are waiting already: refused before it was queued (the server's 429)."""


@dataclass
class Tracked:
    """Where one live request's updates go (its queue on its event loop), what the step thread hands the
    engine (prompt, params) and the arrival TTFT is measured from. Its times are the engine's (the updates
    bring them), and so are the token counts (EngineStats)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: Any
    arrival: float
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop

    def observe(self, update: Any, metrics: Any | None) -> None:
        """The update's token times into the latency histograms, on the engine's clock: TTFT for a
        request's first token (choice 0's), a gap for every later one."""
        times = update.token_times
        if metrics is None or not times:
            return
        if update.prev_token_time is not None:
            metrics.observe_token_gap(times[0] - update.prev_token_time)
        elif update.index == 0:
            metrics.observe_first_token(times[0] - self.arrival)
        for earlier, later in zip(times, times[1:], strict=False):
            metrics.observe_token_gap(later - earlier)

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def send_batch(items: list[tuple[Tracked, Any]]) -> None:
    """Hand a step's updates to their event loops with one wake-up per loop, not one per request: each
    wake-up of the loop's thread takes a core from the model's threads mid-step
    (docs/decisions/sharing-cores-with-the-server.md)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for tracked, item in items:
        by_loop.setdefault(tracked.loop, []).append((tracked.queue, item))
    for loop, queued in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, queued)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass


class RequestStream:
    """One submitted request as the event loop sees it: `async for update in stream`, then `close()`.

    Closing a stream whose request has not finished aborts the request (its KV blocks are freed between
    steps); closing twice, or after the end, does nothing.
    """

    def __init__(self, tracked: Tracked, abort: Any) -> None:
        self.tracked = tracked
        self._abort = abort
        self.finished = False

    @property
    def request_id(self) -> str:
        return self.tracked.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self.tracked.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = bool(item.request_done)  # every choice has finished (n > 1: the last of them)
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
