"""A request's mutable state inside the scheduler (plain data the scheduler alone changes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mixserve.core.batch import RequestId


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Known tokens (prompt + generated), how many of them have K/V in the cache, and where."""

    request_id: RequestId
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    # Positions 0..num_computed-1 have their K/V in the cache (or are being computed this step).
    num_computed: int = 0
    # Tokens to prefill since the last admission: the prompt, or prompt + generated after a preemption.
    prefill_end: int = 0
    # Prefix caching: the chained keys of its first full blocks, computed once as they are needed.
    block_keys: list[bytes] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def is_decode_ready(self) -> bool:
        """Prefill done and every token but the newest computed: its newest token goes in at n - 1."""
        return not self.is_prefilling and self.num_computed == len(self.tokens) - 1
