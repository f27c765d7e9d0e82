"""A speculating decode in the scheduler: its drafts booked (Scheduler.schedule), then its accepted ones
kept and the rest forgotten (Scheduler.update)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mixserve.core.batch import RequestId
from mixserve.core.blocks import BlockSpace
from mixserve.core.request import Request, Status
from mixserve.core.speculative import SpecCounts, Speculation
from mixserve.core.step_draft import StepDraft


def book_drafts(step: StepDraft, spec: Speculation, requests: Mapping[RequestId, Request], block_size: int,
                limit: Callable[[StepDraft, Request, int], int],
                reserve: Callable[[Request, int], bool]) -> None:
    """Where the gate lets them, drafts for the step's decodes, oldest first, in what the budget (and
    `limit`: a target's) leaves, free blocks only: a draft is worth less than any decode or chunk
    (docs/decisions/speculative-decoding.md)."""
    if not spec.gate.allows(len(step.decodes), bool(step.chunks)):
        return
    for rid in list(step.decodes):
        r = requests[rid]
        n = limit(step, r, min(step.budget_left, r.max_tokens - r.num_generated - 1))  # the last row samples
        book_draft(r, step, spec.propose(r, n), block_size, reserve)


def book_draft(r: Request, step: StepDraft, draft: list[int], block_size: int,
               reserve: Callable[[Request, int], bool]) -> None:
    """Add `draft` to `r`'s decode in `step`, cut to the slots of the blocks it holds when `reserve`
    (never preempting: a draft is worth less than anyone's decode or chunk) finds no more."""
    n = len(r.tokens)
    if draft and not reserve(r, n + len(draft)):
        draft = draft[: max(0, len(r.block_table) * block_size - n)]
    if draft:
        step.drafts[r.request_id] = tuple(draft)
        r.num_computed += len(draft)


def keep_verified(r: Request | None, draft: tuple[int, ...], tokens: int | Sequence[int] | None,
                  counts: SpecCounts) -> int:
    """Append the drafts `r` kept (`tokens`: those, then the token after them) and forget the K/V of the
    rejected ones; returns how many were kept (0 for a request finished or aborted since)."""
    if r is None or r.status is not Status.RUNNING or tokens is None:
        return 0
    tokens = [tokens] if isinstance(tokens, int) else list(tokens)
    accepted = len(tokens) - 1
    if not 0 <= accepted <= len(draft) or tokens[:accepted] != list(draft[:accepted]):
        raise ValueError(f"request {r.request_id!r}: sampled {tokens} does not begin with a prefix of its "
                         f"drafts {list(draft)}")
    r.tokens.extend(tokens[:accepted])
    r.num_computed -= len(draft) - accepted  # the rejected drafts' slots: written again by the next tokens
    if r.spec is not None:
        r.spec.record(len(draft), accepted)
    counts.add(len(draft), accepted)
    return accepted


def trim_blocks(r: Request, blocks: BlockSpace, block_size: int) -> None:
    """Give back the blocks only rejected drafts reached: the next decode needs len(tokens) positions."""
    keep = -(-len(r.tokens) // block_size)
    if len(r.block_table) > keep:
        blocks.free(r.block_table[keep:])
        del r.block_table[keep:]
