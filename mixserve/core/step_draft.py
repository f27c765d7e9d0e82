"""The step the scheduler is building: what it holds so far, and the token budget it leaves."""

from __future__ import annotations

from mixserve.core.batch import Chunk, RequestId, ScheduleOutput


class StepDraft:
    """The step being built: what is scheduled so far, and the budget it leaves."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.decodes: dict[RequestId, None] = {}  # dicts: ordered, and a preempted entry leaves in O(1)
        self.chunks: dict[RequestId, Chunk] = {}
        self.drafts: dict[RequestId, tuple[int, ...]] = {}  # a speculating decode's draft tokens
        self.preempted: list[RequestId] = []
        self.sized = False  # chunks sized by the step budget even without decodes (the SLO mode)

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + sum(len(d) for d in self.drafts.values())
                + sum(c.length for c in self.chunks.values()))

    @property
    def budget_left(self) -> int:
        # A prompt running alone may exceed the budget; what is left is then 0, never negative.
        return max(0, self.budget - self.num_tokens)

    @property
    def alone(self) -> bool:
        return not self.decodes and not self.chunks

    def drop(self, rid: RequestId) -> None:
        self.decodes.pop(rid, None)
        self.chunks.pop(rid, None)
        self.drafts.pop(rid, None)

    def output(self) -> ScheduleOutput:
        return ScheduleOutput(list(self.decodes), list(self.chunks.values()), self.preempted,
                              dict(self.drafts))
