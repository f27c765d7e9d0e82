"""Limits on concurrent partial prefills: they hold at every step, and long prompts cannot crowd out
short prompts' first tokens."""

from __future__ import annotations

import random

import pytest

from mixserve.core import BlockPool, Chunk, Chunked, Scheduler, SchedulerConfig
from tests.core.fake_runner import drive, reference

THRESHOLD = 20


def make(max_partial: int, max_long: int, budget: int = 32, chunk: int = 8) -> Scheduler:
    cfg = SchedulerConfig(budget, 64, 4, 2048, max_partial_prefills=max_partial,
                          long_prefill_threshold=THRESHOLD, max_long_partial_prefills=max_long)
    return Scheduler(cfg, BlockPool(2048)).with_prefill_policy(Chunked(chunk))


def in_prefill(s: Scheduler, out) -> list[str]:
    """Prompts part-way through their prefill in this step: given a chunk, or started and not done."""
    chunked = {c.request_id for c in out.chunks}
    partial = {rid for rid in s._requests if s.request(rid).status.value == "running"
               and s.request(rid).is_prefilling}
    return sorted(chunked | partial)


@pytest.mark.parametrize("field", ["max_partial_prefills", "long_prefill_threshold",
                                   "max_long_partial_prefills"])
def test_limits_default_to_none_and_reject_negatives(field):
    assert getattr(SchedulerConfig(8), field) == 0
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(8, **{field: -1})


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("max_partial, max_long", [(1, 0), (2, 1), (3, 1), (0, 2), (4, 2)])
def test_limits_hold_at_every_step(seed, max_partial, max_long):
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    prompts = {}
    for i in range(30):
        n = rng.choice([rng.randint(1, THRESHOLD), rng.randint(THRESHOLD + 1, 90)])
        prompts[f"r{i}"] = ([rng.randrange(1000) for _ in range(n)], rng.randint(1, 6))
        arrivals.setdefault(rng.randint(0, 40), []).append((f"r{i}", *prompts[f"r{i}"]))
    s = make(max_partial, max_long, budget=rng.choice([16, 32, 64]), chunk=rng.choice([4, 8, 64]))
    seen_long = []

    def check(s, out):
        prefilling = in_prefill(s, out)
        longs = [rid for rid in prefilling if len(prompts[rid][0]) > THRESHOLD]
        seen_long.append(len(longs))
        if max_partial:
            assert len(prefilling) <= max_partial, prefilling
        if max_long:
            assert len(longs) <= max_long, longs

    trace = drive(s, arrivals, check_step=check)
    # every request still completes, with the tokens it would have had alone
    assert trace.outputs == {rid: reference(p, m) for rid, (p, m) in prompts.items()}
    assert max(seen_long) >= 1


def test_short_prompt_passes_long_prompts_over_their_limit():
    """L1 and L2 are long (> 20 tokens), S is short; one long prefill at a time: S starts beside L1."""
    s = make(max_partial=3, max_long=1, budget=32, chunk=8)
    arrivals = {0: [("L1", [1] * 40, 1), ("L2", [2] * 40, 1), ("S", [3] * 5, 1)]}
    steps = drive(s, arrivals).steps
    assert steps[0].chunks == [Chunk("L1", 0, 8, False), Chunk("S", 0, 5, True)]
    first_l2 = next(i for i, o in enumerate(steps) if any(c.request_id == "L2" for c in o.chunks))
    last_l1 = next(i for i, o in enumerate(steps) if any(c.request_id == "L1" and c.last for c in o.chunks))
    assert first_l2 >= last_l1  # L2 waits for L1's last chunk, and keeps its place ahead of later arrivals


def test_without_limits_two_prompts_share_a_step():
    """The seed's worked example is unchanged by the defaults."""
    s = make(max_partial=0, max_long=0, budget=8, chunk=4)
    out = drive(s, {0: [("A", [1, 2], 3), ("B", list(range(10)), 1)]}).steps[0]
    assert out.chunks == [Chunk("A", 0, 2, True), Chunk("B", 0, 4, False)]
    s = make(max_partial=1, max_long=0, budget=8, chunk=4)
    out = drive(s, {0: [("A", [1, 2], 3), ("B", list(range(10)), 1)]}).steps[0]
    assert out.chunks == [Chunk("A", 0, 2, True)]
