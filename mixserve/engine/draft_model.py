"""A draft model for speculative decoding: a smaller model with the target's tokenizer proposes each
speculating decode's drafts, greedily, k tokens in k batched forwards.

It has its own runner and KV cache, with as many blocks of the same size as the target's, and it writes
its K/V through the target's block tables: the scheduler's booking of a request's blocks is the draft's
too, so it needs no allocator. It is kept in step with every running request: each step's first draft
forward takes every decode's new tokens and every prefill chunk, drafting or not (as vLLM's draft runs
every step). Catching up only when a decode drafts would be the same work in total, but all of it in the
steps that draft, and the gate (core/draft_gate.py) would then judge drafts by those steps and keep them
off. It follows each request from the tokens it has computed (`_done`); drafts it wrote are not counted:
the next step computes the kept ones again (a few rows), and a rejected one is overwritten. A request
preempted, finished or aborted starts again from 0.

Greedy drafts are one token each (a point mass), so verification's rule keeps the target distribution
exactly (engine/speculative.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq, ScheduleOutput

if TYPE_CHECKING:
    from mixserve.core.scheduler import Scheduler
    from mixserve.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


class DraftModel:
    """Proposes the drafts a step booked (ScheduleOutput.drafts, placeholders until then)."""

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a draft token must be one of its ids
        self._done: dict[str, int] = {}  # request -> tokens whose K/V the draft holds (positions 0..n-1)

    @classmethod
    def load(cls, path: str, target: ModelRunner) -> DraftModel:
        """The model at `path` with the target's KV geometry, device and dtype; ValueError naming
        `speculative` in one line when it cannot be one."""
        from mixserve.model.loader import ModelLoadError
        from mixserve.runner.model_runner import ModelRunner

        if not Path(path).exists():
            raise ValueError(f"speculative: must be '' (off), 'ngram' or a draft model's path; {path!r} "
                             "does not exist")
        if not isinstance(target, ModelRunner):
            raise ValueError("speculative: a draft model runs beside a single-process model "
                             "(tensor_parallel_size 1)")
        backend = target.attention.name if target.attention.name in ("torch", "cpu") else "auto"
        try:
            runner = ModelRunner.from_pretrained(
                path, num_blocks=target.num_blocks, block_size=target.block_size, device=target.device,
                dtype=target.dtype, attention_backend=backend, cuda_graphs=False)
        except (ModelLoadError, ValueError, OSError) as exc:
            why = " ".join(str(exc).split())
            raise ValueError(f"speculative: cannot load the draft model ({why})") from None
        if runner.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
            raise ValueError(f"speculative: the draft model {path!r} has another tokenizer than the model; a "
                             "draft must share the model's tokenizer")
        kv_mb = runner.num_blocks * runner.block_size * runner.kv_bytes_per_token / 1e6
        log.info("draft model %s: %d layers, %.0f MB of KV cache", runner.model_name,
                 runner.config.num_layers, kv_mb)
        return cls(runner, target.config.vocab_size)

    def forget(self, request_id: str) -> None:
        """The request left, or lost its blocks: nothing of it is in the draft's cache any more."""
        self._done.pop(request_id, None)

    def propose(self, scheduler: Scheduler, out: ScheduleOutput) -> None:
        """Write the drafts of every speculating decode into `out.drafts` (as many as booked); the first
        forward also takes the other decodes' new tokens and the chunks that go on from where it is."""
        for rid in out.preempted:
            self.forget(rid)
        limit = self.runner.max_model_len
        want = {rid: len(d) for rid, d in out.drafts.items()}
        ends = {rid: len(scheduler.request(rid).tokens) for rid in want}
        drafting = [rid for rid in want if ends[rid] + want[rid] <= limit]  # within the draft's context
        # the decodes that draft first (their rows give the first drafts), then the others, then chunks
        seqs = [self._catch_up(scheduler, rid, ends[rid]) for rid in drafting]
        for rid in out.decodes:
            n = len(scheduler.request(rid).tokens)
            if rid not in want and n <= limit:
                seqs.append(self._catch_up(scheduler, rid, n))
        for c in out.chunks:
            if self._done.get(c.request_id, 0) == c.start and c.start + c.length <= limit:
                seqs.append(self._catch_up(scheduler, c.request_id, c.start + c.length))
        drafts: dict[str, list[int]] = {rid: [] for rid in drafting}
        if seqs:
            for rid, t in zip(drafting, self._next(seqs), strict=False):  # the chunks' rows come after
                drafts[rid].append(t)
        for j in range(1, max(want.values(), default=0)):  # one token more for each that wants one
            live = [rid for rid in drafting if want[rid] > j]
            if not live:
                break
            step = [ForwardSeq(rid, [drafts[rid][-1]], ends[rid] + j - 1,
                               tuple(scheduler.request(rid).block_table)) for rid in live]
            for rid, t in zip(live, self._next(step), strict=True):
                drafts[rid].append(t)
        for rid in want:
            # past the draft's context: the newest token repeated, rejected at verification like any wrong
            # draft (the booking is already made)
            out.drafts[rid] = tuple(drafts.get(rid) or [scheduler.request(rid).tokens[-1]] * want[rid])

    def _catch_up(self, scheduler: Scheduler, rid: str, end: int) -> ForwardSeq:
        """The request's tokens from where the draft is up to `end`, as one sequence (counted as done)."""
        r, done = scheduler.request(rid), self._done.get(rid, 0)
        self._done[rid] = end
        return ForwardSeq(rid, r.tokens[done:end], done, tuple(r.block_table))

    def _next(self, seqs: list[ForwardSeq]) -> list[int]:
        """One draft forward: each sequence's greedy next token among the target's ids."""
        logits = self.runner.forward(ForwardBatch(seqs))
        return torch.argmax(logits[:, : self.vocab_size], dim=-1).tolist()
