"""A tiny stand-in for the scheduler: drives a ModelRunner through mixed chunked-prefill steps, greedily."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq


@dataclass
class Req:
    """One request of a driven run: its prompt, arrival step, block table and what it produced."""

    rid: str
    prompt: list[int]
    block_table: list[int]
    arrival: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    prefilled: int = 0
    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, logits of that position)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)


def interleaved_tables(num_reqs: int, blocks_each: int, num_blocks: int) -> list[list[int]]:
    """Non-contiguous block tables: request i takes every num_reqs-th block, walked from the top down."""
    order = list(range(num_blocks - 1, -1, -1))
    return [order[i::num_reqs][:blocks_each] for i in range(num_reqs)]


def drive(runner, reqs: list[Req], *, chunk: int, new_tokens: int) -> int:
    """Run steps until every request has `new_tokens` greedy tokens; returns the number of steps.

    Each step decodes every request whose prompt is done and adds one `chunk` of each arrived request still
    prefilling, so decodes and prefill chunks share steps; each sampled row is recorded on its request."""
    step = 0
    while any(len(r.tokens) - len(r.prompt) < new_tokens for r in reqs):
        seqs: list[tuple[Req, ForwardSeq]] = []
        for r in reqs:
            if r.arrival > step or len(r.tokens) - len(r.prompt) >= new_tokens:
                continue
            if r.prefilled >= len(r.prompt):
                n = len(r.tokens)
                seqs.append((r, ForwardSeq(r.rid, r.tokens[-1:], n - 1, r.block_table)))
            else:
                end = min(r.prefilled + chunk, len(r.prompt))
                seqs.append((r, ForwardSeq(r.rid, r.tokens[r.prefilled:end], r.prefilled, r.block_table)))
        step += 1
        if not seqs:
            continue
        logits = runner.forward(ForwardBatch([s for _, s in seqs]))
        assert logits.shape == (len(seqs), runner.config.vocab_size)
        for (r, s), row in zip(seqs, logits, strict=True):
            end = s.start + len(s.tokens)
            if r.prefilled < len(r.prompt):
                r.prefilled = end
                if end < len(r.prompt):
                    continue  # a middle chunk: not sampled
            r.rows.append((end - 1, row.clone()))
            r.tokens.append(int(row.argmax()))
    return step


def max_rel_error(rows: list[tuple[int, torch.Tensor]], reference: torch.Tensor) -> float:
    """Worst |ours - ref| over each sampled row, relative to that row's largest |ref logit|."""
    worst = 0.0
    for pos, row in rows:
        ref = reference[pos].float()
        worst = max(worst, float((row.float() - ref).abs().max() / ref.abs().max()))
    return worst
