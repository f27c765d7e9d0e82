"""Speculative decoding's pure part: n-gram drafts from a request's own tokens, and how many to try.

A speculating decode is booked as 1 + k tokens of the step: its newest token and k draft tokens, run as a
short chunk in the same forward as the other decodes and chunks. The runner's k + 1 logits rows verify
the drafts (engine/speculative.py); the scheduler then keeps the accepted ones (Scheduler.update).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mixserve.core.draft_gate import DraftGate

if TYPE_CHECKING:  # request.py imports SpecStats from here
    from mixserve.core.request import Request

# Longest and shortest suffix matched (longest first). One-token matches propose on almost every step
# and are mostly rejected; on a CPU a rejected draft row is not free (docs/decisions/speculative-decoding.md).
NGRAM_MAX = 4
NGRAM_MIN = 2
# The per-token acceptance rate starts from this prior (as if PRIOR_TESTED tokens had been tested), is
# re-estimated from counts that decay (the prior's weight too), and a draft position is tried while
# rate**position >= MIN_GAIN: the chance that the position's token is kept, against a row's cost.
PRIOR_RATE, PRIOR_TESTED = 0.75, 4.0
DECAY = 0.9
MIN_GAIN = 0.15
# A request whose rate has fallen below MIN_GAIN drafts nothing; after this many decode steps its counts
# are halved and the prior's weight restored, so a request whose text starts to repeat is tried again.
PROBE_AFTER = 32


class NgramIndex:
    """Where each n-gram (n in NGRAM_MIN..NGRAM_MAX) of a growing token list last ended."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions <= this are in _ends

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        size = len(tokens)
        # Index the n-grams ending before the last position: the suffix must match an *earlier* one.
        for end in range(self._indexed + 1, size):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, size - 1)
        if k <= 0:
            return []
        for n in range(min(NGRAM_MAX, size), NGRAM_MIN - 1, -1):
            end = self._ends.get(tuple(tokens[size - n :]))
            if end is not None:
                # what followed `end` then, repeated past the present: a loop of period size - end
                period = size - end
                return [int(tokens[end + j % period]) for j in range(k)]
        return []


@dataclass
class SpecStats:
    """One request's drafts: decayed counts of tokens tested and accepted, and its n-gram index."""

    accepted: float = 0.0
    tested: float = 0.0
    prior_weight: float = PRIOR_TESTED
    idle_steps: int = 0
    index: NgramIndex = field(default_factory=NgramIndex)
    # A request with a grammar: how many leading drafts its grammar allows (the rest would be rejected)
    allowed: Callable[[Sequence[int]], int] | None = None

    @property
    def rate(self) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        return (self.accepted + PRIOR_RATE * self.prior_weight) / (self.tested + self.prior_weight)

    def draft_len(self, k: int) -> int:
        """How many of k drafts are worth a row this step (0: speculation is off for it for now)."""
        rate, n = self.rate, 0
        while n < k and rate ** (n + 1) >= MIN_GAIN:
            n += 1
        if n == 0:
            self.idle_steps += 1
            if self.idle_steps >= PROBE_AFTER:
                self.accepted, self.tested, self.idle_steps = self.accepted / 2, self.tested / 2, 0
                self.prior_weight = PRIOR_TESTED
        return n

    def record(self, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of `drafted` kept (the first rejected one is tested too)."""
        tested = accepted + (1 if accepted < drafted else 0)
        self.accepted = DECAY * self.accepted + accepted
        self.tested = DECAY * self.tested + tested
        self.prior_weight *= DECAY
        if accepted:
            self.idle_steps = 0


# A draft model's tokens are booked as this placeholder and written by the engine before the forward
# (engine/draft_model.py): the booking needs only how many there are.
PENDING = -1
METHODS = ("ngram", "draft")


@dataclass
class Speculation:
    """The scheduler's speculation settings: the method ("ngram", or "draft": a draft model's tokens, filled
    in after booking) and k, the most drafts per decode."""

    num_tokens: int = 4
    method: str = "ngram"
    gate: DraftGate = field(default_factory=DraftGate)  # drafts on where they are measured to pay

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative: unknown method {self.method!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be an integer >= 1, got {self.num_tokens!r}")

    def propose(self, r: Request, limit: int) -> list[int]:
        """This step's drafts for `r`: at most min(k, limit), fewer when its acceptance rate is low."""
        if r.spec is None:
            r.spec = SpecStats()
        k = r.spec.draft_len(min(self.num_tokens, limit)) if limit > 0 else 0
        if self.method == "draft":  # a grammar refuses what it refuses at verification, row by row
            return [PENDING] * k
        draft = r.spec.index.propose(r.tokens, k)
        if draft and r.spec.allowed is not None:
            draft = draft[: r.spec.allowed(draft)]
        return draft


@dataclass
class SpecCounts:
    """Totals since start: decodes that carried drafts, draft tokens, those accepted, and accepted by
    draft position (index 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict:
        """The SchedulerStats fields these fill."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(self.accepted_per_pos)}
