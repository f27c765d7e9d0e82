"""A model-free runner for scheduler tests: a KV cache of (request, position, token) slots.

Every step it writes each sequence's tokens into the slots its block table names, and before each
logits row it reads the request's whole prefix back from those slots. A stale block, a wrong position
or a lost token makes the prefix wrong, and so the next token wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mixserve.core import (
    BlockPool,
    ForwardBatch,
    ForwardSeq,
    PrefillPolicy,
    ScheduleOutput,
    Scheduler,
    SchedulerConfig,
    WholePrompt,
    plan,
)

VOCAB = 1000


def next_token(prefix: Sequence[int]) -> int:
    """The 'model': a deterministic function of every token of the prefix and its order."""
    h = 0
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % VOCAB


def reference(prompt: Sequence[int], max_tokens: int, stop: Callable[[int], bool] | None = None) -> list[int]:
    """What a request must generate: one token at a time, no batching, no cache; `stop` ends it early."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
        if stop is not None and stop(tokens[-1]):
            break
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes and reads K/V 'slots' exactly as the real runner addresses them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[tuple[str, int, int] | None] = [None] * (num_blocks * block_size)

    def _slot(self, seq: ForwardSeq, pos: int) -> int:
        index = pos // self.block_size
        assert index < len(seq.block_table), f"{seq.request_id}: position {pos} has no block"
        return seq.block_table[index] * self.block_size + pos % self.block_size

    def forward(self, batch: ForwardBatch) -> list[int]:
        """One 'logits row' (here: the next token) per sequence, from its prefix as read from the cache."""
        ids = [s.request_id for s in batch.seqs]
        assert len(ids) == len(set(ids)), f"a request appears twice in one step: {ids}"
        held = [b for s in batch.seqs for b in set(s.block_table)]
        assert len(held) == len(set(held)), "two requests of one step share a block"
        rows = []
        for seq in batch.seqs:
            for i, tok in enumerate(seq.tokens):
                self.slots[self._slot(seq, seq.start + i)] = (seq.request_id, seq.start + i, tok)
            prefix = []
            for pos in range(seq.start + len(seq.tokens)):
                entry = self.slots[self._slot(seq, pos)]
                assert entry is not None and entry[:2] == (seq.request_id, pos), (
                    f"{seq.request_id}: slot of position {pos} holds {entry}"
                )
                prefix.append(entry[2])
            rows.append(next_token(prefix))
        return rows


@dataclass
class Trace:
    """What a driven workload did: every step's schedule, and the outputs of finished requests."""

    steps: list[ScheduleOutput] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)


def make_scheduler(
    max_batch_tokens: int,
    policy: PrefillPolicy | None = None,
    *,
    block_size: int = 4,
    num_blocks: int = 1024,
    max_num_seqs: int = 256,
) -> Scheduler:
    cfg = SchedulerConfig(max_batch_tokens, max_num_seqs, block_size, num_blocks)
    return Scheduler(cfg, BlockPool(num_blocks)).with_prefill_policy(policy or WholePrompt())


def run_step(
    s: Scheduler, runner: FakeRunner, stop: Callable[[int], bool] | None = None
) -> tuple[ScheduleOutput, list[str]]:
    """schedule -> plan -> forward -> sample -> update (-> finish on `stop`, as the engine does on EOS);
    returns the schedule and the finished ids."""
    out = s.schedule()
    p = plan(s, out)
    rows = runner.forward(p.batch)
    sampled = {rid: rows[i] for i, rid in p.sample}
    finished = s.update(out, sampled)
    if stop is not None:
        for rid, token in sampled.items():
            if rid not in finished and stop(token):
                s.finish(rid)
                finished.append(rid)
    return out, finished


def drive(
    s: Scheduler,
    arrivals: dict[int, list[tuple[str, list[int], int]]],
    aborts: dict[int, list[str]] | None = None,
    check_step: Callable[[Scheduler, ScheduleOutput], None] | None = None,
    stop: Callable[[int], bool] | None = None,
    max_steps: int = 10_000,
) -> Trace:
    """Run until every request is done: arrivals[i] are added and aborts[i] dropped before step i."""
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size)
    aborts = aborts or {}
    trace = Trace()
    last_event = max([*arrivals, *aborts], default=0)
    for i in range(max_steps):
        for rid, prompt, max_tokens in arrivals.get(i, []):
            s.add_request(rid, prompt, max_tokens)
        for rid in aborts.get(i, []):
            s.abort(rid)
        if i > last_event and not s.has_unfinished():
            return trace
        out, finished = run_step(s, runner, stop)
        trace.steps.append(out)
        for rid in finished:
            trace.outputs[rid] = s.output(rid)
        if check_step is not None:
            check_step(s, out)
    raise AssertionError(f"still unfinished after {max_steps} steps: a deadlock or a starved request")
