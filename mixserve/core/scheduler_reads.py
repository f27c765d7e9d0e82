"""What the scheduler lets others read: requests' tokens and blocks, and the stats snapshot."""

from __future__ import annotations

from collections import deque
from typing import Any

from mixserve.core.batch import RequestId, ScheduleOutput
from mixserve.core.blocks import BlockSpace
from mixserve.core.config import SchedulerConfig
from mixserve.core.request import Request
from mixserve.core.stats import SchedulerStats


class SchedulerReads:
    """The Scheduler's read-only side (a base class: the state is the Scheduler's own)."""

    cfg: SchedulerConfig
    blocks: BlockSpace
    step_budget: Any
    spec_counts: Any
    _cache: Any
    _requests: dict[RequestId, Request]
    _waiting: deque[Request]
    _running: list[Request]
    _num_preemptions: int
    _last_step: ScheduleOutput

    def _get(self, request_id: RequestId) -> Request:
        if (r := self._requests.get(request_id)) is None:
            raise KeyError(f"unknown request {request_id!r}")
        return r

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def tokens(self, request_id: RequestId) -> list[int]:  # prompt + generated so far
        return list(self._get(request_id).tokens)

    def request(self, request_id: RequestId) -> Request:
        """The live state of a request, for plan() and tests: read it, never change it."""
        return self._get(request_id)

    def output(self, request_id: RequestId) -> list[int]:  # generated so far, also once finished
        r = self._get(request_id)
        return r.tokens[r.prompt_len :]

    def block_table(self, request_id: RequestId) -> list[int]:
        return list(self._get(request_id).block_table)

    def stats(self) -> SchedulerStats:
        last = self._last_step
        return SchedulerStats(
            num_requests_running=len(self._running), num_requests_waiting=len(self._waiting),
            num_blocks=self.cfg.num_blocks, num_free_blocks=self.blocks.num_free(),
            num_preemptions=self._num_preemptions,
            step_decode_tokens=len(last.decodes) + last.num_draft_tokens,
            step_prefill_tokens=last.num_tokens - len(last.decodes) - last.num_draft_tokens,
            **(self._cache.stats() if self._cache is not None else {}),
            **self.spec_counts.stats(),
            **(self.step_budget.stats() if self.step_budget is not None else {}),
        )
