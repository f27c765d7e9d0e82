"""Limits on the prompts part-way through their prefill at once (as vLLM V0's max_num_partial_prefills,
long_prefill_token_threshold and max_long_partial_prefills; V1 dropped them)."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from mixserve.core.config import SchedulerConfig


class Admit(enum.Enum):
    YES = "yes"
    SKIP = "skip"  # a long prompt over max_long_partial_prefills: shorter prompts behind it may start
    STOP = "stop"  # max_partial_prefills reached: no prompt starts in this step


class PartialPrefills:
    """The prompts in prefill in the step being built, counted against the config's limits (0 = none).

    Built from the running requests still part-way through their prefill when phase 2 of schedule()
    starts: each holds a place until its last chunk is scheduled, whether or not it gets a chunk now.
    """

    def __init__(self, cfg: SchedulerConfig, in_flight: Iterable[int]) -> None:
        self.cfg = cfg
        lengths = list(in_flight)
        self.num = len(lengths)
        self.num_long = sum(1 for n in lengths if self.is_long(n))

    def is_long(self, prefill_len: int) -> bool:
        t = self.cfg.long_prefill_threshold
        return t > 0 and prefill_len > t

    def admits(self, prefill_len: int) -> Admit:
        """May a waiting prompt of `prefill_len` tokens start its prefill in this step?"""
        cfg = self.cfg
        if cfg.max_partial_prefills and self.num >= cfg.max_partial_prefills:
            return Admit.STOP
        if self.is_long(prefill_len) and cfg.max_long_partial_prefills and \
                self.num_long >= cfg.max_long_partial_prefills:
            return Admit.SKIP
        return Admit.YES

    def add(self, prefill_len: int) -> None:
        """A prompt started its prefill in this step."""
        self.num += 1
        self.num_long += self.is_long(prefill_len)
