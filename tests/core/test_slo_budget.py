"""The SLO mode in the core (core/slo.py) on a fake clock: slack bookkeeping, giving up, deadline order,
the waiting-age bound, mixed or exclusive steps, and properties over random workloads."""

from __future__ import annotations

import math
import random

import pytest

from mixserve.core import Chunked, ScheduleOutput, Scheduler, SchedulerConfig
from mixserve.core.cost_model import CostCoefficients, StepCostModel, step_features
from mixserve.core.request import Request
from mixserve.core.slo import PROBE_EVERY, WAIT_BOUND_TTFTS, SloBudget, SloTargets, step_budget_for
from mixserve.core.tpot_budget import TpotBudget

COST = CostCoefficients(overhead_s=0.02, per_token_s=0.001, per_pair_s=0.0, per_seq_s=0.001)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def slo_scheduler(cost: CostCoefficients = COST, ttft: float = 2.0, tpot: float = 0.2, budget: int = 512,
                  num_blocks: int = 4096) -> tuple[Scheduler, SloBudget, Clock]:
    clock = Clock()
    slo = SloBudget(StepCostModel(cost), SloTargets(ttft, tpot), clock)
    cfg = SchedulerConfig(max_batch_tokens=budget, max_num_seqs=64, block_size=16, num_blocks=num_blocks)
    s = Scheduler(cfg).with_prefill_policy(Chunked(budget)).with_step_budget(slo)
    return s, slo, clock


def run_step(s: Scheduler, clock: Clock, cost: CostCoefficients) -> ScheduleOutput:
    """One engine step: schedule, the clock advanced by the step's predicted time, one token per row."""
    out = s.schedule()
    seqs = [(len(s.request(r).tokens) - 1, 1) for r in out.decodes]
    seqs += [(c.start, c.length) for c in out.chunks]
    clock.t += cost.predict(step_features(seqs))
    rows = [*out.decodes, *(c.request_id for c in out.chunks if c.last)]
    for rid in s.update(out, {rid: 7 for rid in rows}):
        s.abort(rid)
    return out


def test_per_token_share_ahead_on_and_behind_pace() -> None:
    """A decode's share is (first + (N-1) tpot - now) / (N - g): tpot on pace, more ahead, less behind."""
    slo = SloBudget(StepCostModel(COST), SloTargets(2.0, 0.2), Clock())
    r = Request("a", [1] * 11, 10, max_tokens=11)  # 1 token generated
    r.first_token_s = 10.0
    assert slo.per_token_s(r, 10.0) == pytest.approx(0.2)  # on pace: (10 + 10 * 0.2 - 10) / 10
    assert slo.per_token_s(r, 9.0) == pytest.approx(0.3)  # ahead
    assert slo.per_token_s(r, 11.0) == pytest.approx(0.1)  # behind
    r.arrival_s = 3.0
    assert slo.ttft_deadline(r) == 5.0


def test_a_prompt_that_cannot_make_its_ttft_is_given_up_once_and_still_served() -> None:
    """A 3,000-token prompt (3 s alone) against a 2 s TTFT: given up at once, counted once, finished."""
    s, slo, clock = slo_scheduler(budget=4096)
    s.add_request("long", [1] * 3000, 4)
    for _ in range(50):
        if not s.has_unfinished():
            break
        run_step(s, clock, COST)
    assert not s.has_unfinished() and slo.counts.given_up_ttft == 1


def test_a_hopeless_decode_no_longer_limits_the_step() -> None:
    """A decode whose share is below a decode-only step is given up on TPOT; the limit then ignores it."""
    s, slo, clock = slo_scheduler(tpot=0.2)
    s.add_request("late", [1] * 8, 20)
    run_step(s, clock, COST)  # its prefill and first token
    clock.t += 30.0  # far behind its pace now
    s.add_request("next", [1] * 8, 20)
    s.schedule()
    assert slo.counts.given_up_tpot == 1 and s.request("late").slo_given_up
    assert slo.target_s == pytest.approx(2 * 0.2)  # only the cap, not the late one's negative share


def test_given_up_prefill_waits_behind_a_fresh_prompt() -> None:
    """A given-up prompt part-way through its prefill gets no chunk while a fresh prompt that can still
    make its TTFT takes the budget first."""
    s, slo, clock = slo_scheduler(budget=256)
    s.add_request("long", [1] * 3000, 2)
    run_step(s, clock, COST)
    assert s.request("long").slo_given_up and s.request("long").is_prefilling
    s.add_request("fresh", [1] * 200, 2)
    out = s.schedule()
    assert [c.request_id for c in out.chunks][0] == "fresh"


def test_a_request_waiting_past_the_bound_goes_first() -> None:
    """ordered(): given-up requests last, except one older than WAIT_BOUND_TTFTS TTFT SLOs: first."""
    slo = SloBudget(StepCostModel(COST), SloTargets(2.0, 0.2), Clock())
    old, fresh, lost = (Request(n, [1], 1, 1) for n in ("old", "fresh", "lost"))
    old.slo_given_up, old.arrival_s = True, 0.0
    lost.slo_given_up, lost.arrival_s = True, 30.0
    fresh.arrival_s = 35.0
    slo.now = 1.0
    assert [r.request_id for r in slo.ordered([old, fresh, lost])] == ["fresh", "old", "lost"]
    slo.now = WAIT_BOUND_TTFTS * 2.0 + 0.5
    assert [r.request_id for r in slo.ordered([old, fresh, lost])] == ["old", "fresh", "lost"]


def test_exclusive_only_where_decodes_beside_a_chunk_cost_more_than_a_step() -> None:
    """No mixed-decode cost: always mixed. Decodes dear beside a chunk: a decode-only step, then a
    prefill-only one, counted, each step's mode said."""
    decodes = step_features([(100, 1)] * 16)
    cheap = SloBudget(StepCostModel(COST), SloTargets(2.0, 0.2), Clock())
    cheap.target_s = 0.3
    assert not cheap.exclusive(decodes, 0, 256)
    dear_cost = CostCoefficients(0.02, 0.001, 0.0, 0.001, per_mixed_decode_s=0.01)
    s, slo, clock = slo_scheduler(dear_cost, budget=512)
    for i in range(16):
        s.add_request(f"d{i}", [1] * 4, 30)
    run_step(s, clock, dear_cost)  # all 16 prompts in one step
    s.add_request("p", [1] * 300, 2)
    first = run_step(s, clock, dear_cost)
    assert first.decodes and not first.chunks and slo.mode == "decode-only"
    second = run_step(s, clock, dear_cost)
    assert second.chunks and not second.decodes and slo.mode == "prefill-only"
    assert slo.counts.exclusive_steps == 1


def test_without_a_tpot_slo_the_exclusive_choice_compares_step_times() -> None:
    """Only a TTFT SLO (no limit): exclusive when two steps are predicted shorter than the mixed one."""
    decodes = step_features([(100, 1)] * 16)
    for mixed_cost, want in ((0.0, False), (0.01, True)):
        c = CostCoefficients(0.02, 0.001, 0.0, 0.001, per_mixed_decode_s=mixed_cost)
        slo = SloBudget(StepCostModel(c), SloTargets(2.0, 0.0), Clock())
        slo.begin_step([], [])
        assert math.isinf(slo.target_s) and slo.exclusive(decodes, 0, 256) is want


def test_step_budget_for_picks_the_mode() -> None:
    """SLO set: SloBudget (TPOT from slo_tpot_ms, else the target); a target alone: TpotBudget; else None."""
    m = StepCostModel(COST)
    b = step_budget_for(m, 400, 2000, 150)
    assert isinstance(b, SloBudget) and b.targets == SloTargets(2.0, 0.15)
    b = step_budget_for(m, 400, 2000, 0)
    assert isinstance(b, SloBudget) and b.targets == SloTargets(2.0, 0.4)
    assert type(step_budget_for(m, 400)) is TpotBudget and step_budget_for(m, 0) is None
    for bad in ((-1.0, 0.2), (float("nan"), 0.2), (0.0, 0.0)):
        with pytest.raises(ValueError):
            SloTargets(*bad)


def test_stats_report_the_slo_fields() -> None:
    """SchedulerStats carries the given-up counts, exclusive steps, the step's limit and mode."""
    s, _, clock = slo_scheduler()
    s.add_request("a", [1] * 3000, 2)
    run_step(s, clock, COST)
    st = s.stats()
    assert st.slo_given_up_ttft == 1 and st.slo_exclusive_steps == 0 and st.slo_mode == "mixed"
    assert st.slo_step_limit_s == pytest.approx(0.4)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_budget_decodes_blocks_and_the_age_bound(seed: int) -> None:
    """Over random arrivals, lengths, SLOs and costs (exclusive steps included): no step over the budget
    (a lone chunk aside), no decode skipped two steps running, every request done, every block back, and
    a request that waited past the bound admitted before any that came after it had."""
    rng = random.Random(seed)
    cost = CostCoefficients(rng.uniform(0.005, 0.05), rng.uniform(1e-4, 2e-3), rng.uniform(0, 1e-7),
                            rng.uniform(0, 2e-3), rng.choice((0.0, rng.uniform(0, 0.01))))
    ttft, tpot = rng.choice((0.5, 2.0)), rng.choice((0.0, 0.1, 0.3))
    budget = rng.choice((64, 256, 1024))
    s, slo, clock = slo_scheduler(cost, ttft, tpot, budget)
    arrivals = sorted(rng.uniform(0, 20) for _ in range(40))
    pending = [(t, f"r{i}", rng.randint(1, 3000), rng.randint(1, 64)) for i, t in enumerate(arrivals)]
    skipped: dict[str, int] = {}
    admitted_at: dict[str, float] = {}
    for _ in range(20_000):
        while pending and pending[0][0] <= clock.t:
            _, rid, n, m = pending.pop(0)
            s.add_request(rid, [1] * n, m)
        if not s.has_unfinished():
            if not pending:
                break
            clock.t = pending[0][0]
            continue
        ready = [r.request_id for r in s._running if r.is_decode_ready]
        out = run_step(s, clock, cost)
        assert out.num_tokens <= budget or (len(out.chunks) == 1 and not out.decodes)
        for rid in ready:
            skipped[rid] = 0 if rid in out.decodes or rid in out.preempted else skipped.get(rid, 0) + 1
            assert skipped[rid] <= 1, f"{rid} went two steps without its decode"
        for c in out.chunks:
            admitted_at.setdefault(c.request_id, clock.t)
    assert not pending and not s.has_unfinished()
    assert s.blocks.num_free() == s.cfg.num_blocks
    arrival = {f"r{i}": a for i, a in enumerate(arrivals)}
    late = slo.targets.wait_bound_s + 5.0  # the bound, and the longest step here and the queue's turn
    for a in arrival:
        for b in arrival:
            if arrival[b] > arrival[a] + late:  # b came when a had waited past the bound: a goes first
                assert admitted_at[a] <= admitted_at[b], f"{b} admitted before {a}, which waited longer"


def test_every_eighth_exclusive_choice_is_a_mixed_probe() -> None:
    """A cost model where exclusive always wins: PROBE_EVERY - 1 choices in a row say exclusive, the
    next says mixed (so per_mixed_decode keeps being fitted on mixed steps), then the run starts over."""
    dear = CostCoefficients(0.02, 0.001, 0.0, 0.001, per_mixed_decode_s=0.01)
    slo = SloBudget(StepCostModel(dear), SloTargets(2.0, 0.2), clock=lambda: 0.0)
    slo.target_s = 0.4
    decodes = step_features([(10, 1)] * 16)
    choices = [slo.exclusive(decodes, 0, 512) for _ in range(2 * PROBE_EVERY)]
    probe = [True] * (PROBE_EVERY - 1) + [False]
    assert choices == probe + probe
    assert slo.counts.exclusive_steps == 2 * (PROBE_EVERY - 1)
