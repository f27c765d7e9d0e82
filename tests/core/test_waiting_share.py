"""Under a TPOT target, waiting prompts that fit whole in their share of a step go before a long prompt's
chunks (core/waiting_share.py); with the target off, the order is the old one."""

from __future__ import annotations

import pytest

from mixserve.core import BlockPool, Chunked, Scheduler, SchedulerConfig, plan
from mixserve.core.cost_model import CostCoefficients, StepCostModel, StepFeatures, step_features
from mixserve.core.tpot_budget import TpotBudget
from mixserve.core.waiting_share import WAITING_SHARE, WaitingShare

# 50 ms a step, 1 ms a token, no attention term: a chunk's time is its length in ms
COST = CostCoefficients(overhead_s=0.05, per_token_s=0.001, per_pair_s=0.0)
TARGET_S = 0.4


def make(target: bool) -> Scheduler:
    cfg = SchedulerConfig(2048, max_num_seqs=64, block_size=16, num_blocks=1024)
    s = Scheduler(cfg, BlockPool(1024)).with_prefill_policy(Chunked(2048 if target else 256))
    return s.with_step_budget(TpotBudget(StepCostModel(COST), TARGET_S)) if target else s


def step(s: Scheduler, log: list) -> None:
    out = s.schedule()
    p = plan(s, out)
    log.append((out, step_features((q.start, len(q.tokens)) for q in p.batch.seqs)))
    s.update(out, {rid: 1 for _, rid in p.sample})


def first_token_step(log: list, rid: str) -> int:
    """The index of the step that sampled `rid`'s first token."""
    return next(i for i, (out, _) in enumerate(log)
                if any(c.request_id == rid and c.last for c in out.chunks))


def long_then_short(target: bool, short_len: int = 40) -> tuple[Scheduler, list, int]:
    """Four streams decoding, a 1,500-token prompt starting its prefill, then a short prompt arriving."""
    s, log = make(target), []
    for i in range(4):
        s.add_request(f"d{i}", [1] * 10, 200)
    step(s, log)
    s.add_request("long", [1] * 1500, 4)
    step(s, log)  # the long prompt's first chunk
    assert s.request("long").is_prefilling
    s.add_request("short", [1] * short_len, 4)
    arrived = len(log)
    while s.has_unfinished() and len(log) < 60:
        step(s, log)
    return s, log, arrived


def test_a_short_prompt_gets_its_first_token_in_the_next_step_not_after_the_long_prompt():
    _, log, arrived = long_then_short(target=True)
    assert first_token_step(log, "short") == arrived  # its whole prompt in the first step after it came
    assert first_token_step(log, "long") > arrived + 2  # while the long prompt still had chunks to go
    for out, f in log:  # and no step went over the target
        if out.decodes and out.chunks:
            assert COST.predict(f) <= TARGET_S + 1e-12


def test_the_long_prompt_keeps_at_least_the_rest_of_the_share():
    _, log, arrived = long_then_short(target=True)
    out, f = log[arrived]
    chunks = {c.request_id: c.length for c in out.chunks}
    decodes_s = COST.predict(StepFeatures(len(out.decodes), 0))
    chunk_s = TARGET_S - decodes_s
    assert chunks["short"] * COST.per_token_s <= WAITING_SHARE * chunk_s + 1e-12
    assert chunks["long"] * COST.per_token_s >= (1 - WAITING_SHARE) * chunk_s - COST.per_token_s


def test_a_prompt_too_big_for_the_share_waits_for_the_long_prompt_as_before():
    too_big = int(WAITING_SHARE * (TARGET_S - 0.054) / COST.per_token_s) + 20
    _, log, arrived = long_then_short(target=True, short_len=too_big)
    assert first_token_step(log, "short") >= first_token_step(log, "long")


def test_without_a_target_the_short_prompt_waits_behind_the_long_prompts_chunks():
    # chunk 256 at budget 2048: the long prompt takes 256 a step and the short one fits beside it
    # (phase 3 after phase 2), so it is served in the next step as well; what must not change is the order
    s, log, arrived = long_then_short(target=False)
    out, _ = log[arrived]
    assert [c.request_id for c in out.chunks] == ["long", "short"]


def test_shorter_prompts_pass_one_too_big_for_the_share_and_arrival_order_is_kept():
    s, log = make(True), []
    for i in range(4):
        s.add_request(f"d{i}", [1] * 10, 200)
    step(s, log)
    s.add_request("long", [1] * 1500, 4)
    step(s, log)
    s.add_request("big", [1] * 150, 4)  # over the share (86 ms of 346): waits
    s.add_request("small", [1] * 30, 4)  # fits: passes it
    step(s, log)
    out, _ = log[-1]
    assert [c.request_id for c in out.chunks] == ["small", "long"]
    assert [r.request_id for r in s._waiting] == ["big"]


def test_share_bounds():
    budget = TpotBudget(StepCostModel(COST), TARGET_S)
    with pytest.raises(ValueError, match="share"):
        WaitingShare(budget, StepFeatures(), share=1.5)
    share = WaitingShare(budget, StepFeatures(4, 4), share=0.45)
    assert not share.take(100, budget_left=99)  # never more tokens than the step has left
    # the share is 155.7 ms: 100 + 50 tokens fit, 10 more do not, 5 do
    assert share.take(100, 2000) and share.take(50, 2000) and share.take(10, 2000) is False
    assert share.take(5, 2000) and share.take(1, 2000) is None  # full: nothing more is looked at
    assert WaitingShare(budget, StepFeatures(4, 4), share=0.5).take(1, budget_left=0) is None


def test_share_zero_schedules_as_before_and_bad_shares_are_refused():
    s = make(True)
    s.with_step_budget(s.step_budget, waiting_share=0.0)
    log: list = []
    for i in range(4):
        s.add_request(f"d{i}", [1] * 10, 200)
    step(s, log)
    s.add_request("long", [1] * 1500, 4)
    step(s, log)
    s.add_request("short", [1] * 40, 4)
    while s.has_unfinished() and len(log) < 60:
        step(s, log)
    assert first_token_step(log, "short") >= first_token_step(log, "long")  # behind every chunk, as before
    with pytest.raises(ValueError, match="waiting_share"):
        make(False).with_step_budget(TpotBudget(StepCostModel(COST), TARGET_S), waiting_share=-0.1)


def test_a_prompt_the_share_admits_gets_one_chunk_per_step_whatever_the_policy():
    # a policy chunk (16) shorter than the prompt (40): the share admits it with its first 16 tokens; the
    # partial prefills that follow must not give it a second chunk, which replaced the first in the step
    s = make(True).with_prefill_policy(Chunked(16))
    log: list = []
    for i in range(4):
        s.add_request(f"d{i}", [1] * 10, 200)
    step(s, log)
    step(s, log)  # the four prompts (16 a step) are in, all decoding
    s.add_request("short", [1] * 40, 4)
    out = s.schedule()
    chunk = next(c for c in out.chunks if c.request_id == "short")
    assert (chunk.start, chunk.length) == (0, 16) and s.request("short").num_computed == 16
