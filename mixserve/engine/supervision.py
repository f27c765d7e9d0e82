"""What keeps the step loop honest: a failpoint for tests, a restart budget, and the hung-step rule.

Decision (issue 13): a step that *raises* fails the requests in flight and the engine is restarted in
the same process (every request is dropped from the scheduler, so every KV block is free again), up to
`max_engine_restarts` times in `RESTART_WINDOW_S`; past that, or when a step *hangs* past the watchdog
(a thread stuck in a kernel cannot be taken back), or an error marked `permanent` (a dead
tensor-parallel rank: distributed/tp_runner.py), the engine is dead and `mixserve serve` exits non-zero
so that a supervisor (systemd, Docker, Kubernetes) starts a fresh process, as vLLM's server does.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

FAULT_ENV = "MIXSERVE_FAULT_STEP"
RESTART_WINDOW_S = 60.0
MIN_STEP_TIMEOUT_S = 60.0
STEP_TIMEOUT_FACTOR = 10.0
SLOW_STEP_S = 0.05  # `N:slow`: what each step from N on is lengthened to at least


class InjectedFault(RuntimeError):
    """Raised by the failpoint: the step a test asked to fail."""


@dataclass
class Failpoint:
    """`MIXSERVE_FAULT_STEP=N` makes step N (counted from 1 by the server's step loop) raise once;
    `N:hang` makes it block instead, as a kernel that never returns would; `N:slow` makes every step from
    N on wait SLOW_STEP_S first, so that a test's requests outlast a deadline on however fast a machine.
    Unset: nothing happens."""

    step: int = 0
    hang: bool = False
    fired: bool = False
    slow: bool = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Failpoint:
        raw = (environ if environ is not None else os.environ).get(FAULT_ENV, "").strip()
        if not raw:
            return cls()
        number, _, mode = raw.partition(":")
        if not number.isdigit() or int(number) < 1 or mode not in ("", "raise", "hang", "slow"):
            raise ValueError(f"{FAULT_ENV}: expected N, N:hang or N:slow with N >= 1, got {raw!r}")
        return cls(int(number), hang=mode == "hang", slow=mode == "slow")

    def check(self, step: int) -> None:
        if self.slow:
            if self.step and step >= self.step:
                time.sleep(SLOW_STEP_S)  # a slow kernel, injected: not synchronisation
            return
        if self.fired or step != self.step:
            return
        self.fired = True
        if self.hang:
            threading.Event().wait()  # forever; the GIL is released, so the watchdog can see it
        raise InjectedFault(f"{FAULT_ENV}={self.step}: step {step} failed on purpose")


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float = RESTART_WINDOW_S) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def allow(self, now: float | None = None) -> bool:
        """Record a restart at `now` if the budget has room for it; False when it has none."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


def step_timeout(longest_step_s: float, configured_s: float) -> float:
    """How long a step may run before it counts as hung: the configured value, or by default
    max(60 s, 10x the longest step so far)."""
    if configured_s > 0:
        return configured_s
    return max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR * longest_step_s)


class StepClock:
    """The steps of one step loop: how many ran, the longest, and when the running one began; `watch`
    (on a thread of its own) declares the loop dead when a step (not the first: it may compile or warm
    up) runs past `step_timeout`."""

    def __init__(self, configured_timeout_s: float = 0.0) -> None:
        self.configured_timeout_s = configured_timeout_s
        self.num_steps = 0
        self.longest_s = 0.0
        self.started: float | None = None  # set while a step runs

    def begin(self) -> int:
        """A step begins; returns its number (from 1)."""
        self.started = time.monotonic()
        return self.num_steps + 1

    def end(self) -> None:
        if self.started is not None:
            self.longest_s = max(self.longest_s, time.monotonic() - self.started)
            self.num_steps += 1
        self.started = None

    def abandon(self) -> None:
        """The step raised: not counted, not timed."""
        self.started = None

    def watch(self, alive: Callable[[], bool], die: Callable[[BaseException], None]) -> None:
        while alive():
            limit = step_timeout(self.longest_s, self.configured_timeout_s)
            time.sleep(min(1.0, limit / 10))
            started = self.started
            if started is not None and self.num_steps > 0 and time.monotonic() - started > limit:
                die(TimeoutError(f"step {self.num_steps + 1} ran past the watchdog's {limit:.1f} s"))
                return
