"""A model-free runner for prefix-caching tests: K/V slots that several requests may read.

fake_runner.FakeRunner tags every slot with the request that wrote it, so it cannot allow sharing. Here
a slot holds (position, token) only; before each logits row the runner reads the whole prefix back
through the block table and asserts it equals the request's true tokens (a cached block with the wrong
tokens, a wrong start or a stale slot fails at once). Every write asserts that the block is held by the
writer alone and is not registered in the cache: nobody overwrites K/V that someone else reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mixserve.core import (
    Chunked,
    ForwardBatch,
    PrefillPolicy,
    PrefixCachingPool,
    ScheduleOutput,
    Scheduler,
    SchedulerConfig,
    plan,
)
from tests.core.fake_runner import next_token


class CachingFakeRunner:
    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.block_size = s.cfg.block_size
        self.slots: list[tuple[int, int] | None] = [None] * (s.cfg.num_blocks * s.cfg.block_size)
        self.prefill_tokens = 0  # prompt tokens actually computed (what the cache saves)

    def forward(self, batch: ForwardBatch) -> list[int]:
        pool = self.s.blocks
        rows = []
        for seq in batch.seqs:
            table = seq.block_table
            for i, tok in enumerate(seq.tokens):
                pos = seq.start + i
                block = table[pos // self.block_size]
                if isinstance(pool, PrefixCachingPool):
                    assert pool.refs(block) == 1, f"{seq.request_id} writes into shared block {block}"
                    assert not pool.is_cached(block), f"{seq.request_id} overwrites cached block {block}"
                self.slots[block * self.block_size + pos % self.block_size] = (pos, tok)
            end = seq.start + len(seq.tokens)
            truth = self.s.tokens(seq.request_id)[:end]
            prefix = []
            for pos in range(end):
                entry = self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size]
                assert entry is not None and entry[0] == pos, f"{seq.request_id}: slot {pos} holds {entry}"
                prefix.append(entry[1])
            assert prefix == truth, f"{seq.request_id}: the cache gives a wrong prefix"
            rows.append(next_token(prefix))
        return rows


def held_counts(s: Scheduler, rids: list[str]) -> dict[int, int]:
    """How many live block tables hold each block: what the pool's reference counts must say."""
    counts: dict[int, int] = {}
    for rid in rids:
        for b in s.block_table(rid):
            counts[b] = counts.get(b, 0) + 1
    return counts


def check_pool(s: Scheduler, live: list[str]) -> None:
    """The pool's own invariants, and its reference counts against the requests' block tables."""
    pool = s.blocks
    assert isinstance(pool, PrefixCachingPool)
    pool.check()
    counts = held_counts(s, live)
    assert all(pool.refs(b) == counts.get(b, 0) for b in range(pool.num_blocks)), "refs != block tables"


def make_cached(beta: int, policy: PrefillPolicy | None = None, *, block_size: int = 4, num_blocks: int = 256,
                max_num_seqs: int = 256, caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(beta, max_num_seqs, block_size, num_blocks, enable_prefix_caching=caching)
    return Scheduler(cfg).with_prefill_policy(policy or Chunked(beta))


@dataclass
class Run:
    steps: list[ScheduleOutput] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    prefill_tokens: int = 0


def run(
    s: Scheduler,
    arrivals: dict[int, list[tuple[str, list[int], int]]],
    aborts: dict[int, list[str]] | None = None,
    stop: Callable[[int], bool] | None = None,
    max_steps: int = 10_000,
) -> Run:
    """Drive to the end: arrivals[i] added and aborts[i] dropped before step i; pool checked every step."""
    runner = CachingFakeRunner(s)
    aborts = aborts or {}
    live: list[str] = []
    result = Run()
    last_event = max([*arrivals, *aborts], default=0)
    for i in range(max_steps):
        for rid, prompt, max_tokens in arrivals.get(i, []):
            s.add_request(rid, prompt, max_tokens)
            live.append(rid)
        for rid in aborts.get(i, []):
            if rid in live:
                s.abort(rid)
                live.remove(rid)
        if i > last_event and not s.has_unfinished():
            return result
        out = s.schedule()
        p = plan(s, out)
        rows = runner.forward(p.batch)
        sampled = {rid: rows[k] for k, rid in p.sample}
        finished = s.update(out, sampled)
        for rid, token in sampled.items():
            if rid not in finished and stop is not None and stop(token):
                s.finish(rid)
                finished.append(rid)
        for rid in finished:
            result.outputs[rid] = s.output(rid)
            live.remove(rid)
        result.steps.append(out)
        result.prefill_tokens += sum(c.length for c in out.chunks)
        if isinstance(s.blocks, PrefixCachingPool):
            check_pool(s, live)
    raise AssertionError(f"still unfinished after {max_steps} steps")
