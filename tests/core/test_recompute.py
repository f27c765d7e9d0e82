"""Random workloads through the fake runner with a tight KV cache: preemption by recompute never
loses, repeats or corrupts a token, never deadlocks, and never leaks a block."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mixserve.core import Chunked, ScheduleOutput, Scheduler, WholePrompt
from tests.core.fake_runner import drive, make_scheduler, reference


def is_eos(token: int) -> bool:
    return token % 11 == 0  # frequent enough that many requests end early


def run_workload(seed: int, use_eos: bool) -> Scheduler:
    """One random workload: arrivals over time, some aborts, the fewest blocks that still fit each request."""
    rng = random.Random(seed)
    beta = rng.randint(2, 24)
    policy = WholePrompt() if rng.random() < 0.3 else Chunked(rng.randint(1, 2 * beta))
    block_size = rng.choice([1, 2, 4, 8])
    requests = [
        (f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 3 * beta))], rng.randint(1, 8))
        for i in range(rng.randint(1, 10))
    ]
    num_blocks = max(math.ceil((len(p) + m) / block_size) for _, p, m in requests) + rng.randint(0, 3)
    arrivals: dict[int, list] = {}
    for req in requests:
        arrivals.setdefault(rng.randint(0, 10), []).append(req)
    aborts: dict[int, list[str]] = {}
    for at, reqs in arrivals.items():
        for rid, _, _ in reqs:
            if rng.random() < 0.15:
                aborts.setdefault(at + rng.randint(0, 6), []).append(rid)
    s = make_scheduler(
        beta, policy, block_size=block_size, num_blocks=num_blocks, max_num_seqs=rng.randint(1, 8)
    )

    def check(s: Scheduler, out: ScheduleOutput) -> None:
        s.blocks.check()
        alone = isinstance(policy, WholePrompt) and not out.decodes and len(out.chunks) == 1
        assert out.num_tokens <= beta or alone
        assert len(out.decodes) + len(out.chunks) <= s.cfg.max_num_seqs

    stop = is_eos if use_eos else None
    trace = drive(s, arrivals, aborts, check_step=check, stop=stop)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid, prompt, max_tokens in requests:
        if rid not in aborted:
            assert trace.outputs[rid] == reference(prompt, max_tokens, stop), f"seed {seed}: {rid}"
    s.blocks.check()
    assert s.blocks.num_free() == num_blocks, f"seed {seed}: blocks leaked"
    return s


def test_random_workloads_with_forced_preemption_match_the_reference():
    preemptions = sum(
        run_workload(seed, use_eos=seed % 2 == 1).stats().num_preemptions for seed in range(300)
    )
    assert preemptions > 50  # the cache really was tight: recompute was exercised, not just possible


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_any_workload_matches_the_reference(seed, use_eos):
    run_workload(seed, use_eos)
