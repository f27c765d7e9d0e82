"""Plain data passed from the scheduler to the runner: one step's mixed batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

RequestId = str


@dataclass(frozen=True)
class Chunk:
    """Tokens `start .. start+length` of a request, prefilled in this step; `last` if it reaches the end."""

    request_id: RequestId
    start: int
    length: int
    last: bool


@dataclass(frozen=True)
class ScheduleOutput:
    """What one step computes: decodes (one token each) first, then prefill chunks."""

    decodes: list[RequestId] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class ForwardSeq:
    """One sequence of the mixed batch: `tokens` at absolute positions `start ..`; K/V via `block_table`."""

    request_id: RequestId
    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class ForwardBatch:
    """Every sequence of one step; the runner returns one logits row per sequence (its last token)."""

    seqs: list[ForwardSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)


@dataclass(frozen=True)
class StepPlan:
    """The batch to run and the (logits row, request) pairs to sample: decodes and `last` chunks only."""

    batch: ForwardBatch
    sample: list[tuple[int, RequestId]]
