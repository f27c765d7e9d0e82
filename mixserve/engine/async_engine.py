"""AsyncEngine: the server's step loop. One background thread steps LLMEngine; the event loop never blocks.

Adds and aborts go through a thread-safe inbox that the thread drains between steps; each request's
updates come back on its own asyncio.Queue (engine/streams.py). Only the step thread touches the
LLMEngine (except `validate`, which is pure). A step that raises fails the requests in flight and the
engine goes on (a restart); too many restarts, or a step that hangs past the watchdog, kill it
(engine/supervision.py says why).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from mixserve.engine.inbox import Inbox
from mixserve.engine.served_model import ServedModel
from mixserve.engine.streams import (
    EngineBusyError,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    Tracked,
    send_batch,
)
from mixserve.engine.supervision import Failpoint, RestartBudget, StepClock

if TYPE_CHECKING:
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.engine.outputs import RequestUpdate
    from mixserve.engine.sampling_params import SamplingParams
    from mixserve.metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineBusyError", "EngineDeadError", "RequestFailedError", "RequestStream"]

logger = logging.getLogger(__name__)


def thread_alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


class AsyncEngine:
    """Serves an `LLMEngine` to asyncio code: `async for update in engine.generate(...)`."""

    def __init__(self, llm_engine: LLMEngine, metrics: ServerMetrics | None = None, idle_timeout: float = 1.0,
                 *, step_timeout_s: float = 0.0, max_engine_restarts: int = 3,
                 failpoint: Failpoint | None = None) -> None:
        self.llm = llm_engine  # the step thread's alone; the server reads `model`
        self.model = ServedModel.of(llm_engine)
        self.metrics = metrics
        self.clock = StepClock(step_timeout_s)  # 0: max(60 s, 10x the longest step so far)
        self.on_dead: Callable[[BaseException], None] | None = None  # called once, from any thread
        self.num_restarts = 0
        self._restarts = RestartBudget(max_engine_restarts)
        self._failpoint = failpoint if failpoint is not None else Failpoint.from_env()
        self._idle_timeout = idle_timeout  # the thread re-checks its stop flag at least this often
        self._inbox = Inbox()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._accepting = True
        self._error: BaseException | None = None
        self._num_live = 0  # requests the step thread tracks (streams still open)
        self._live: dict[str, Tracked] = {}  # owned by the step thread

    # -- lifecycle
    @property
    def healthy(self) -> bool:
        """False once the engine is dead (too many restarts, or a hung step)."""
        return self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

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
            thread = self._thread

            def alive() -> bool:
                return thread.is_alive() and not self._stop_requested and self._error is None

            threading.Thread(target=self.clock.watch, args=(alive, self._die), name="mixserve-watchdog",
                             daemon=True).start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` seconds, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while (self._num_live + self._inbox.pending_adds > 0 and self.running and self._error is None
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        self._stop_requested = True
        self._wake.set()
        thread = self._thread
        if thread is not None:  # a dead engine's thread may be hung in a step: not worth waiting for
            wait = 0.5 if self._error is not None else max(deadline - time.monotonic(), 0.0) + 5.0
            await asyncio.to_thread(thread.join, wait)
        with self._lock:
            if self._thread is thread and not thread_alive(thread):
                self._thread = None  # a later start() runs a fresh loop

    def num_waiting(self) -> int:
        """Requests not yet running: still in the inbox or waiting in the scheduler."""
        return self._inbox.num_waiting

    # -- requests
    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               arrival: float | None = None, *, max_waiting: int | None = None) -> RequestStream:
        """Queue a request now (no await between the check and the queueing, so admission is atomic).

        EngineDeadError if the engine is dead or stopped; EngineBusyError if `max_waiting` requests are
        waiting already. The caller must `close()` the stream (it aborts an unfinished request).
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine is not running: {self._error}")
        if not self._accepting:
            raise EngineDeadError("the engine is stopped (the server is shutting down)")
        self._start_thread()  # in case no one called start(): an app used without its lifespan
        arrival = time.monotonic() if arrival is None else arrival
        loop = asyncio.get_running_loop()  # per request: tests may run each request on its own loop
        tracked = Tracked(request_id, list(prompt_token_ids), params, arrival, asyncio.Queue(), loop)
        self._inbox.add(tracked, max_waiting)
        self._wake.set()
        if self.metrics is not None:  # counted as waiting from the moment it is admitted
            self.metrics.waiting.set(self.num_waiting())
        return RequestStream(tracked, self.abort)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       arrival: float | None = None) -> AsyncIterator[RequestUpdate]:
        """Yield the request's `RequestUpdate`s until it finishes; leaving early (cancel, close) aborts it."""
        stream = self.submit(request_id, prompt_token_ids, params, arrival)
        try:
            async for update in stream:
                yield update
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Drop a request between steps, freeing its KV blocks; unknown or finished ids are a no-op."""
        self._inbox.abort(request_id)
        self._wake.set()

    # -- the step thread
    def _run(self) -> None:
        while True:
            try:
                self._step_until_stopped()
                break
            except Exception as exc:  # a failed step: fail its requests, restart if the budget allows
                if not self._restart(exc):
                    return
            except BaseException as exc:
                self._die(exc)
                return
        stopped = EngineDeadError("the server is shutting down")
        self._fail(self._inbox.take_adds() + list(self._live.values()), stopped)
        self._abort_live()

    def _step_until_stopped(self) -> None:
        while not self._stop_requested and self._error is None:
            if self._drain_inbox():
                self._observe_stats(stepped=False)  # adds and aborts change the gauges before any step
            if not self.llm.has_unfinished():
                self._wake.wait(self._idle_timeout)
                self._wake.clear()
                continue
            try:
                self._failpoint.check(self.clock.begin())
                updates = self.llm.step()
            except BaseException:
                self.clock.abandon()
                raise
            self.clock.end()
            self._dispatch(updates)
            self._observe_stats(stepped=True)

    def _restart(self, exc: Exception) -> bool:
        """Fail the requests in flight, drop them from the engine; False (and dead) if that cannot be."""
        logger.error("engine step %d failed: %r", self.clock.num_steps + 1, exc, exc_info=exc)
        self._fail(list(self._live.values()), EngineDeadError(f"the engine step failed ({exc!r}); "
                                                              "the engine was restarted, retry the request"))
        self._abort_live()
        if self._error is not None:
            return False  # the watchdog declared it dead meanwhile
        if getattr(exc, "permanent", False) or self.llm.has_unfinished() or not self._restarts.allow():
            self._die(exc)
            return False
        self.num_restarts += 1
        if self.metrics is not None:
            self.metrics.engine_restarts.inc()
        logger.warning("engine restarted (%d so far); requests queued since go on", self.num_restarts)
        self._observe_stats(stepped=False)
        return True

    def _die(self, exc: BaseException) -> None:
        """The engine cannot serve again: every request hears it, then `on_dead` (the server exits)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        logger.error("the engine is dead: %r", exc)
        self._fail(self._inbox.take_adds() + list(self._live.values()),
                   EngineDeadError(f"the engine step loop died: {exc!r}"))
        if self.on_dead is not None:
            self.on_dead(exc)

    def _drain_inbox(self) -> bool:
        changed = False
        while (entry := self._inbox.pop()) is not None:
            kind, item = entry
            changed = True
            if kind == "add":
                self._add(item)
            else:
                self._abort(item)
        return changed

    def _add(self, tracked: Tracked) -> None:
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

    def _dispatch(self, updates: Sequence[RequestUpdate]) -> None:
        now = time.monotonic()
        outgoing: list[tuple[Tracked, Any]] = []
        for update in updates:
            tracked = self._live.get(update.request_id)
            if tracked is None:
                continue  # aborted while this step ran
            tracked.observe(update, self.metrics)
            if update.request_done:
                del self._live[update.request_id]
                self._num_live = len(self._live)
                if self.metrics is not None:
                    end = update.token_times[-1] if update.token_times else now
                    self.metrics.observe_finished(end - tracked.arrival)
            outgoing.append((tracked, update))
        send_batch(outgoing)

    def _observe_stats(self, *, stepped: bool) -> None:
        stats = self.llm.stats()  # EngineStats: the gauges and every counter of /metrics come from it
        pending = self._inbox.set_scheduler_waiting(stats.num_requests_waiting)
        if self.metrics is not None:
            self.metrics.observe_stats(stats, stepped=stepped, extra_waiting=pending)

    @staticmethod
    def _fail(tracked: list[Tracked], error: BaseException) -> None:
        for t in tracked:
            t.send(error)

    def _abort_live(self) -> None:
        """Drop every live request from the engine (its stream has been told already)."""
        for request_id in list(self._live):
            try:
                self.llm.abort(request_id)
            except Exception:  # the engine may be broken; has_unfinished() tells the caller
                logger.exception("aborting %s after a failed step", request_id)
        self._live.clear()
        self._num_live = 0
