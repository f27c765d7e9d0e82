"""From a schedule to what the runner computes: the mixed batch and the logits rows to sample."""

from __future__ import annotations

from mixserve.core.batch import ForwardBatch, ForwardSeq, ScheduleOutput, StepPlan
from mixserve.core.scheduler import Scheduler


def plan(s: Scheduler, out: ScheduleOutput) -> StepPlan:
    """One ForwardSeq per decode, then one per chunk, in `out`'s order; sample decodes and `last` chunks.

    A speculating decode is its newest token and its drafts, with a logits row for each (the first
    verifies the first draft, the last follows the last draft)."""
    seqs: list[ForwardSeq] = []
    sample = []
    rows = 0  # logits rows so far: one per sequence, 1 + k for a decode with k drafts
    for rid in out.decodes:
        r = s.request(rid)
        n = len(r.tokens)
        draft = out.drafts.get(rid, ())
        # The newest token goes in at n - 1: position n does not exist yet (it is what we sample).
        seqs.append(ForwardSeq(rid, [*r.tokens[n - 1 :], *draft], n - 1, tuple(r.block_table),
                               1 + len(draft)))
        sample.append((rows, rid))
        rows += 1 + len(draft)
    for c in out.chunks:
        r = s.request(c.request_id)
        tokens = r.tokens[c.start : c.start + c.length]
        seqs.append(ForwardSeq(c.request_id, tokens, c.start, tuple(r.block_table)))
        # A middle chunk's last row predicts a token the prompt already has: computed, then dropped.
        if c.last:
            sample.append((rows, c.request_id))
        rows += 1
    return StepPlan(ForwardBatch(seqs), sample, dict(out.drafts))


def split(n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) pairs covering 0..n in chunks of `chunk` (0 counts as 1); the last may be short."""
    if n < 0:
        raise ValueError(f"split: n must be >= 0, got {n}")
    chunk = max(chunk, 1)
    return [(start, min(chunk, n - start)) for start in range(0, n, chunk)]
