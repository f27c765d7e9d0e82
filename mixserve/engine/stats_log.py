"""The engine's periodic log line (as vLLM's): load, KV cache use, prefix cache hit rate, throughput.

Logged at INFO on the `mixserve.engine` logger at most every LOG_INTERVAL_S seconds, from the step loop;
`mixserve serve --log-level info` shows it. Nothing is computed while INFO is off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mixserve.core.stats import EngineStats  # the data; this module formats it

log = logging.getLogger("mixserve.engine")
LOG_INTERVAL_S = 10.0


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


class StatsLog:
    """Formats one line per interval from the engine's totals (differences since the last line)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_time: float | None = None
        self._last = (0, 0, 0, 0)  # prompt tokens, generation tokens, prefix queries, prefix hits

    def maybe_log(self, stats: Callable[[], EngineStats], now: float | None = None) -> str | None:
        """Log (and return) the line if INFO is on and the interval has passed since the last one."""
        if not log.isEnabledFor(logging.INFO):
            return None
        now = time.monotonic() if now is None else now
        if self._last_time is None:
            self._last_time = now  # the first interval starts at the first step
            return None
        if now - self._last_time < self.interval_s:
            return None
        line = self.line(stats(), now - self._last_time)
        self._last_time = now
        log.info("%s", line)
        return line

    def line(self, s: EngineStats, elapsed: float) -> str:
        sch = s.scheduler
        totals = (s.num_prompt_tokens_total, s.num_generation_tokens_total, sch.prefix_cache_queries,
                  sch.prefix_cache_hits)
        prompt, gen, queries, hits = (now - last for now, last in zip(totals, self._last, strict=True))
        self._last = totals
        since_start = _pct(sch.prefix_cache_hits, sch.prefix_cache_queries)
        spec = ""
        if sch.spec_num_draft_tokens:  # speculation on and drafting: how many drafts are kept, since start
            spec = (f", drafts accepted {_pct(sch.spec_num_accepted_tokens, sch.spec_num_draft_tokens)} "
                    f"({sch.spec_num_accepted_tokens / max(sch.spec_num_drafts, 1):.2f} per draft)")
        return (f"engine: {sch.num_requests_running} running, {sch.num_requests_waiting} waiting, "
                f"prompt {prompt / elapsed:.1f} tok/s, generation {gen / elapsed:.1f} tok/s, "
                f"KV cache {100.0 * sch.kv_cache_usage:.1f}% used, prefix cache hit rate "
                f"{_pct(hits, queries)} ({since_start} since start), {sch.num_preemptions} preemptions{spec}")
