"""A model-free runner for scheduler tests: a KV cache of (request, position, token) slots.

Every step it writes each sequence's tokens into the slots its block table names, and before each
logits row it reads the request's whole prefix back from those slots. A stale block, a wrong position
or a lost token makes the prefix wrong, and so the next token wrong; run_step also checks each prefix
read against the scheduler's own tokens (plus the step's drafts).

A speculating decode (num_logits = 1 + k) gets a row per draft: row j follows its prefix up to draft j,
and run_step verifies the drafts greedily against those rows, as the engine does.
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
from mixserve.core.prefix_cache import PrefixCachingPool
from mixserve.core.speculative import Speculation

VOCAB = 1000
Model = Callable[[Sequence[int]], int]


def next_token(prefix: Sequence[int]) -> int:
    """The 'model': a deterministic function of every token of the prefix and its order."""
    h = 0
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % VOCAB


LOOP_PERIOD = 5


def looping_token(prefix: Sequence[int]) -> int:
    """A 'model' whose text repeats: mostly the token LOOP_PERIOD back (so n-gram drafts are often right),
    a fresh token a quarter of the time; which one, next_token of the whole prefix decides."""
    h = next_token(prefix)
    return prefix[-LOOP_PERIOD] if len(prefix) >= LOOP_PERIOD and h % 4 else h


def reference(prompt: Sequence[int], max_tokens: int, stop: Callable[[int], bool] | None = None,
              model: Model = next_token) -> list[int]:
    """What a request must generate: one token at a time, no batching, no cache; `stop` ends it early."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model(tokens))
        if stop is not None and stop(tokens[-1]):
            break
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes and reads K/V 'slots' exactly as the real runner addresses them.

    With `pool` (a PrefixCachingPool) requests may share cached blocks: a read then checks the slot's
    position only (run_step checks its token), and a write must go to a block its writer holds alone."""

    def __init__(self, num_blocks: int, block_size: int, model: Model = next_token,
                 pool: PrefixCachingPool | None = None) -> None:
        self.block_size = block_size
        self.model = model
        self.pool = pool
        self.slots: list[tuple[str, int, int] | None] = [None] * (num_blocks * block_size)
        self.prefixes: dict[str, list[int]] = {}  # the last forward's prefix read back, per request

    def _slot(self, seq: ForwardSeq, pos: int) -> int:
        index = pos // self.block_size
        assert index < len(seq.block_table), f"{seq.request_id}: position {pos} has no block"
        return seq.block_table[index] * self.block_size + pos % self.block_size

    def forward(self, batch: ForwardBatch) -> list[int]:
        """`num_logits` 'logits rows' (here: next tokens) per sequence, one after each of its last
        num_logits tokens, from its prefix as read from the cache."""
        ids = [s.request_id for s in batch.seqs]
        assert len(ids) == len(set(ids)), f"a request appears twice in one step: {ids}"
        if self.pool is None:
            held = [b for s in batch.seqs for b in set(s.block_table)]
            assert len(held) == len(set(held)), "two requests of one step share a block"
        rows = []
        self.prefixes = {}
        for seq in batch.seqs:
            assert 1 <= seq.num_logits <= len(seq.tokens), f"{seq.request_id}: {seq.num_logits} rows"
            for i, tok in enumerate(seq.tokens):
                if self.pool is not None:
                    block = seq.block_table[(seq.start + i) // self.block_size]
                    assert self.pool.refs(block) == 1 and not self.pool.is_cached(block), (
                        f"{seq.request_id} writes into shared or cached block {block}"
                    )
                self.slots[self._slot(seq, seq.start + i)] = (seq.request_id, seq.start + i, tok)
            prefix = []
            for pos in range(seq.start + len(seq.tokens)):
                entry = self.slots[self._slot(seq, pos)]
                ok = entry is not None and (entry[1] == pos if self.pool is not None
                                            else entry[:2] == (seq.request_id, pos))
                assert ok, f"{seq.request_id}: slot of position {pos} holds {entry}"
                prefix.append(entry[2])
            self.prefixes[seq.request_id] = prefix
            end = len(prefix)
            rows.extend(self.model(prefix[: end - seq.num_logits + 1 + j]) for j in range(seq.num_logits))
        return rows


def verify_greedy(draft: Sequence[int], rows: Sequence[int]) -> list[int]:
    """The drafts that `rows` (1 + len(draft) of them) agree with, then the token where they part."""
    kept = 0
    while kept < len(draft) and rows[kept] == draft[kept]:
        kept += 1
    return [*draft[:kept], rows[kept]]


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
    speculation: Speculation | None = None,
    prefix_caching: bool = False,
) -> Scheduler:
    """A scheduler with a plain BlockPool, or with prefix caching its own default pool (new_pool)."""
    cfg = SchedulerConfig(max_batch_tokens, max_num_seqs, block_size, num_blocks,
                          enable_prefix_caching=prefix_caching)
    s = Scheduler(cfg) if prefix_caching else Scheduler(cfg, BlockPool(num_blocks))
    return s.with_prefill_policy(policy or WholePrompt()).with_speculation(speculation)


def runner_for(s: Scheduler, model: Model = next_token) -> FakeRunner:
    """A FakeRunner for `s`'s KV cache, allowing shared blocks if its pool caches prefixes."""
    pool = s.blocks if isinstance(s.blocks, PrefixCachingPool) else None
    return FakeRunner(s.cfg.num_blocks, s.cfg.block_size, model, pool)


def run_step(
    s: Scheduler, runner: FakeRunner, stop: Callable[[int], bool] | None = None
) -> tuple[ScheduleOutput, list[str]]:
    """schedule -> plan -> forward -> sample (verify drafts greedily) -> update (-> finish on `stop`, as
    the engine does on EOS); returns the schedule and the finished ids."""
    out = s.schedule()
    p = plan(s, out)
    rows = runner.forward(p.batch)
    assert len(rows) == p.batch.num_logits
    for rid, prefix in runner.prefixes.items():
        truth = [*s.tokens(rid), *p.drafts.get(rid, ())][: len(prefix)]
        assert prefix == truth, f"{rid}: the cache gives {prefix}, its tokens are {truth}"
    sampled: dict[str, int | list[int]] = {}
    for i, rid in p.sample:
        draft = p.drafts.get(rid)
        sampled[rid] = rows[i] if draft is None else verify_greedy(draft, rows[i : i + 1 + len(draft)])
    finished = s.update(out, sampled)
    if stop is not None:
        for rid, token in sampled.items():
            if rid not in finished and any(stop(t) for t in (token if isinstance(token, list) else [token])):
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
    speculation: Speculation | None = None,
    model: Model = next_token,
) -> Trace:
    """Run until every request is done: arrivals[i] are added and aborts[i] dropped before step i; with
    `speculation`, decodes carry drafts from the start."""
    if speculation is not None:
        s.with_speculation(speculation)
    runner = runner_for(s, model)
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
