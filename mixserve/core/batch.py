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
    """What one step computes: decodes (one token each, plus `drafts[rid]` when it speculates) first,
    then prefill chunks."""

    decodes: list[RequestId] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)
    drafts: dict[RequestId, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_draft_tokens + sum(c.length for c in self.chunks)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts.values())


@dataclass(frozen=True)
class ForwardSeq:
    """One sequence of the mixed batch: `tokens` at absolute positions `start ..`; K/V via `block_table`.
    `num_logits`: how many of its last tokens get a logits row (more than 1: a decode verifying drafts)."""

    request_id: RequestId
    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    num_logits: int = 1


@dataclass(frozen=True)
class ForwardBatch:
    """Every sequence of one step; the runner returns `num_logits` rows per sequence (its last tokens)."""

    seqs: list[ForwardSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)


@dataclass(frozen=True)
class StepPlan:
    """The batch to run and the (logits row, request) pairs to sample: decodes and `last` chunks only. A
    speculating decode's row is the first of 1 + len(drafts[rid]) consecutive rows, one per draft and one
    after the last."""

    batch: ForwardBatch
    sample: list[tuple[int, RequestId]]
    drafts: dict[RequestId, tuple[int, ...]] = field(default_factory=dict)
