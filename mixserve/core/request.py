"""A request's mutable state inside the scheduler (plain data the scheduler alone changes)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from mixserve.core.batch import RequestId
from mixserve.core.config import SchedulerConfig
from mixserve.core.speculative import SpecStats


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
    # Speculative decoding: its acceptance counts and n-gram index (core/speculative.py); None: off.
    spec: SpecStats | None = None
    # Serving to an SLO (core/slo.py): when it arrived and got its first token (the budget's clock), and
    # whether it can no longer meet its SLO (still served, no longer protected).
    arrival_s: float = 0.0
    first_token_s: float | None = None
    slo_given_up: bool = False

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


def new_request(request_id: RequestId, prompt: Sequence[int], max_tokens: int,
                cfg: SchedulerConfig) -> Request:
    """A waiting request; ValueError if it is empty, asks for < 1 token or can never fit the KV cache."""
    if len(prompt) == 0:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
    if len(prompt) + max_tokens > cfg.num_slots:
        raise ValueError(
            f"request {request_id!r}: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the "
            f"KV cache ({cfg.num_blocks} blocks x {cfg.block_size} tokens)"
        )
    return Request(request_id, [int(t) for t in prompt], len(prompt), max_tokens)
