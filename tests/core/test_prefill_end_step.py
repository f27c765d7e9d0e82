"""Under a TPOT target, the step that ends a prompt's prefill takes nothing after that last chunk
(core/scheduler.py, phase 2): its first token is not held back by other prompts' tokens. With the target
off, the step fills its budget as before."""

from __future__ import annotations

import pytest

from mixserve.core import BlockPool, Chunked, Scheduler, SchedulerConfig, plan
from mixserve.core.cost_model import CostCoefficients, StepCostModel, step_features
from mixserve.core.tpot_budget import TpotBudget

# 50 ms a step, 1 ms a token, no attention term: a chunk's time is its length in ms
COST = CostCoefficients(overhead_s=0.05, per_token_s=0.001, per_pair_s=0.0)
TARGET_S = 0.4


def run(target: bool, share: float) -> list:
    """Four streams decoding, an 800-token prompt, then six 60-token prompts arriving during its prefill;
    every step until all are done, as (output, predicted seconds)."""
    cfg = SchedulerConfig(2048, max_num_seqs=64, block_size=16, num_blocks=1024)
    s = Scheduler(cfg, BlockPool(1024)).with_prefill_policy(Chunked(2048 if target else 256))
    if target:
        s.with_step_budget(TpotBudget(StepCostModel(COST), TARGET_S), waiting_share=share)
    log = []

    def step() -> None:
        out = s.schedule()
        p = plan(s, out)
        log.append((out, COST.predict(step_features((q.start, len(q.tokens)) for q in p.batch.seqs))))
        s.update(out, {rid: 1 for _, rid in p.sample})

    for i in range(4):
        s.add_request(f"d{i}", [1] * 10, 300)
    step()
    s.add_request("long", [1] * 800, 4)
    step()
    for i in range(6):
        s.add_request(f"short{i}", [1] * 60, 4)
        step()
    while s.has_unfinished() and len(log) < 400:
        step()
    assert not s.has_unfinished()
    return log


def ending_steps(log: list) -> list:
    """The steps holding the last chunk of a prefill that began in an earlier step."""
    return [(out, t) for out, t in log if any(c.last and c.start > 0 for c in out.chunks)]


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_under_a_target_nothing_follows_the_chunk_that_ends_a_prefill(share: float) -> None:
    log = run(target=True, share=share)
    ends = ending_steps(log)
    assert any(c.request_id == "long" for out, _ in ends for c in out.chunks)
    for out, predicted in ends:
        assert out.chunks[-1].last and out.chunks[-1].start > 0  # scheduled last: nothing came after it
        assert predicted <= TARGET_S + 1e-12
    long_end = next(i for i, (out, _) in enumerate(log) if any(c.request_id == "long" and c.last
                                                                for c in out.chunks))
    out, predicted = log[long_end]
    assert predicted < TARGET_S - 0.1  # the ending step is cut short, not filled with the short prompts
    if share == 0.0:  # every short prompt waited behind the long one, and starts right after it
        assert [c.request_id for c in out.chunks] == ["long"]
        assert {c.request_id for c in log[long_end + 1][0].chunks} >= {f"short{i}" for i in range(3)}


def test_without_a_target_the_ending_step_still_fills_its_budget() -> None:
    log = run(target=False, share=0.0)
    long_end = next(out for out, _ in log if any(c.request_id == "long" and c.last for c in out.chunks))
    assert len(long_end.chunks) > 1 and long_end.chunks[0].request_id == "long"
