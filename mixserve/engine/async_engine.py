"""AsyncEngine: the server's step loop. One background thread steps LLMEngine; the event loop never blocks.

Adds and aborts go through a thread-safe inbox that the thread drains between steps; each request's
updates come back on its own asyncio.Queue through `loop.call_soon_threadsafe`. Only the step thread
touches the LLMEngine (except `validate`, which is pure).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def thread_alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


class EngineDeadError(RuntimeError):
    """The step loop died (or was stopped): no request can run any more."""


class RequestFailedError(RuntimeError):
    """The engine refused or dropped one request; the others carry on."""


@dataclass
class _Tracked:
    """What the step thread knows of one live request: where its updates go and its token times."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: Any
    arrival: float
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    first_token: float | None = None
    last_token: float | None = None

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def send_batch(items: list[tuple[_Tracked, Any]]) -> None:
    """Hand a step's updates to their event loops with one wake-up per loop, not one per request: each
    wake-up of the loop's thread takes a core from the model's threads mid-step (measured with 32 streams
    on 2 cores: bench/serve_overhead.py)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for tracked, item in items:
        by_loop.setdefault(tracked.loop, []).append((tracked.queue, item))
    for loop, queued in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, queued)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Serves an `LLMEngine` to asyncio code: `async for update in engine.generate(...)`."""

    def __init__(self, llm_engine: Any, metrics: Any | None = None, idle_timeout: float = 1.0) -> None:
        self.llm = llm_engine
        self.metrics = metrics
        self._idle_timeout = idle_timeout  # the thread re-checks its stop flag at least this often
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._accepting = True
        self._error: BaseException | None = None
        self._pending_adds = 0  # in the inbox, not yet handed to the engine
        self._scheduler_waiting = 0  # from the last stats snapshot
        self._num_live = 0  # requests the step thread tracks (streams still open)
        self._live: dict[str, _Tracked] = {}  # owned by the step thread

    # -- lifecycle
    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def healthy(self) -> bool:
        """False once the step loop has died."""
        return self._error is None

    @property
    def accepting(self) -> bool:
        """False between stop() and the next start()."""
        return self._accepting

    @property
    def running(self) -> bool:
        return thread_alive(self._thread)

    async def start(self) -> None:
        """Start the step thread (idempotent); after stop() it starts a fresh one."""
        with self._lock:
            self._accepting = True
        self._start_thread()

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None or not self._accepting or self._error is not None:
                return
            self._stop_requested = False
            self._thread = threading.Thread(target=self._run, name="mixserve-step-loop", daemon=True)
            self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` seconds, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._num_live + self._pending_adds > 0 and self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stop_requested = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, max(deadline - time.monotonic(), 0.0) + 5.0)
        with self._lock:
            if self._thread is thread and not thread_alive(thread):
                self._thread = None  # a later start() runs a fresh loop

    def num_waiting(self) -> int:
        """Requests not yet running: still in the inbox or waiting in the scheduler."""
        return self._pending_adds + self._scheduler_waiting

    # -- requests
    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: Any,
                       arrival: float | None = None) -> AsyncIterator[Any]:
        """Yield the request's `RequestUpdate`s until it finishes; leaving early (cancel, close) aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine is not running: {self._error}")
        if not self._accepting:
            raise EngineDeadError("the engine is stopped (the server is shutting down)")
        self._start_thread()  # in case no one called start(): an app used without its lifespan
        arrival = time.monotonic() if arrival is None else arrival
        loop = asyncio.get_running_loop()  # per request: tests may run each request on its own loop
        tracked = _Tracked(request_id, list(prompt_token_ids), params, arrival, asyncio.Queue(), loop)
        with self._lock:
            self._pending_adds += 1
            self._inbox.append(("add", tracked))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await tracked.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request between steps, freeing its KV blocks; unknown or finished ids are a no-op."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # -- the step thread
    def _run(self) -> None:
        try:
            while not self._stop_requested:
                if self._drain_inbox():
                    self._observe_stats(stepped=False)  # adds and aborts change the gauges before any step
                if not self.llm.has_unfinished():
                    self._wake.wait(self._idle_timeout)
                    self._wake.clear()
                    continue
                updates = self.llm.step()
                self._dispatch(updates)
                self._observe_stats(stepped=True)
            self._abort_all(EngineDeadError("the server is shutting down"))
        except BaseException as exc:  # the loop is dead: every waiting stream must hear about it
            logger.exception("the engine step loop died")
            self._error = exc
            self._abort_all(EngineDeadError(f"the engine step loop died: {exc!r}"))

    def _drain_inbox(self) -> bool:
        changed = False
        while True:
            with self._lock:
                if not self._inbox:
                    return changed
                kind, item = self._inbox.popleft()
                if kind == "add":
                    self._pending_adds -= 1
            changed = True
            if kind == "add":
                self._add(item)
            else:
                self._abort(item)

    def _add(self, tracked: _Tracked) -> None:
        try:
            self.llm.add_request(tracked.request_id, list(tracked.prompt_token_ids), tracked.params,
                                 arrival=tracked.arrival)
        except (ValueError, KeyError, TypeError) as exc:  # refused: this request fails, the loop carries on
            tracked.send(RequestFailedError(str(exc)))
            return
        self._live[tracked.request_id] = tracked
        self._num_live = len(self._live)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is None:
            return  # finished already, or never added
        self._num_live = len(self._live)
        self.llm.abort(request_id)

    def _dispatch(self, updates: Sequence[Any]) -> None:
        now = time.monotonic()
        m = self.metrics
        outgoing: list[tuple[_Tracked, Any]] = []
        for update in updates:
            tracked = self._live.get(update.request_id)
            if tracked is None:
                continue  # aborted while this step ran
            n = len(update.new_token_ids)
            if n and m is not None:
                if tracked.first_token is None:
                    m.observe_first_token(now - tracked.arrival, len(tracked.prompt_token_ids))
                else:
                    m.observe_token_gap(now - (tracked.last_token or now))
                for _ in range(n - 1):  # several tokens in one update arrived together
                    m.observe_token_gap(0.0)
                m.observe_generated(n)
            if n:
                tracked.first_token = tracked.first_token or now
                tracked.last_token = now
            if update.finished:
                del self._live[update.request_id]
                self._num_live = len(self._live)
                if m is not None:
                    m.observe_finished(now - tracked.arrival)
            outgoing.append((tracked, update))
        send_batch(outgoing)

    def _observe_stats(self, *, stepped: bool) -> None:
        stats = self.llm.stats()
        stats = getattr(stats, "scheduler", stats)  # EngineStats may wrap the SchedulerStats
        self._scheduler_waiting = stats.num_requests_waiting
        if self.metrics is not None:
            self.metrics.observe_stats(stats, stepped=stepped, extra_waiting=self._pending_adds)

    def _abort_all(self, error: BaseException) -> None:
        with self._lock:
            pending = [item for kind, item in self._inbox if kind == "add"]
            self._inbox.clear()
            self._pending_adds = 0
        for tracked in [*pending, *self._live.values()]:
            tracked.send(error)
        for request_id in list(self._live):
            try:
                self.llm.abort(request_id)
            except Exception:  # the engine may be broken; the streams are told already
                pass
        self._live.clear()
        self._num_live = 0
