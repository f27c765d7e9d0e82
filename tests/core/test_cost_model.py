"""The step cost model and the TPOT-target budget: the fit, the file, and the budget's guarantees."""

from __future__ import annotations

import random

import pytest

from mixserve.core import BlockPool, Chunked, Scheduler, SchedulerConfig, plan
from mixserve.core.cost_model import (
    NUM_FEATURES,
    CostCoefficients,
    StepCostModel,
    StepFeatures,
    attended_pairs,
    step_features,
)
from mixserve.core.tpot_budget import TpotBudget
from tests.core.budget_case import budget_case

TRUE = CostCoefficients(overhead_s=0.02, per_token_s=0.0015, per_pair_s=4e-8)


def test_attended_pairs_is_causal():
    assert attended_pairs(0, 1) == 1
    assert attended_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attended_pairs(9, 1) == 10  # a decode at position 9 attends to 10 positions
    assert attended_pairs(4, 2) == 5 + 6
    # chunking changes when the pairs are computed, never how many
    assert attended_pairs(0, 10) == attended_pairs(0, 4) + attended_pairs(4, 4) + attended_pairs(8, 2)
    assert step_features([(9, 1), (0, 4)]) == StepFeatures(5, 20, 2, 1)  # one decode


def _random_step(rng: random.Random) -> StepFeatures:
    decodes = [(rng.randint(30, 1500), 1) for _ in range(rng.randint(0, 40))]
    chunks = [(rng.randint(0, 1200), rng.randint(1, 400)) for _ in range(rng.randint(0, 2))]
    return step_features(decodes + chunks) if decodes or chunks else StepFeatures(1, 1)


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(400):
        f = _random_step(rng)
        model.observe(f, TRUE.predict(f) * rng.uniform(0.99, 1.01))  # 1% noise
    got = model.coefficients
    assert got.overhead_s == pytest.approx(TRUE.overhead_s, rel=0.1)
    assert got.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.05)
    assert got.per_pair_s == pytest.approx(TRUE.per_pair_s, rel=0.1)
    for f in (StepFeatures(1, 100), StepFeatures(512, 200_000), StepFeatures(2048, 2_000_000)):
        assert model.predict(f) == pytest.approx(TRUE.predict(f), rel=0.02)


def test_fit_recovers_a_per_sequence_cost_that_tokens_alone_cannot_explain():
    """A decode costs more than a prompt token (its row is sampled and detokenized): with per_seq_s the
    fit finds it, and a fit on tokens alone (the model before it) mispredicts decode-only steps by size."""
    true = CostCoefficients(overhead_s=0.04, per_token_s=0.001, per_pair_s=8e-7, per_seq_s=0.0015)
    rng = random.Random(5)
    model = StepCostModel()
    for _ in range(400):
        f = _random_step(rng)
        model.observe(f, true.predict(f) * rng.uniform(0.99, 1.01))
    got = model.coefficients
    assert got.per_seq_s == pytest.approx(true.per_seq_s, rel=0.1)
    assert got.per_token_s == pytest.approx(true.per_token_s, rel=0.1)
    few, many = step_features([(100, 1)] * 4), step_features([(100, 1)] * 30)
    for f in (few, many):
        assert model.predict(f) == pytest.approx(true.predict(f), rel=0.03)
    old = model.fit(num_features=3)  # the same steps, no sequence feature
    assert old.per_seq_s == 0
    assert old.predict(few) > 1.05 * true.predict(few) and old.predict(many) < 0.97 * true.predict(many)


def test_a_model_file_from_before_per_seq_s_loads_as_its_coefficients(tmp_path):
    old = {"format": "mixserve-step-cost/1", "overhead_s": 0.05, "per_token_s": 0.001, "per_pair_s": 1e-6,
           "num_samples": 7, "buckets": {"5": {"xx": [[1.0] * 3] * 3, "xy": [1.0] * 3, "yy": 1.0,
                                                "weight": 1.0}}}  # three features' sums
    model = StepCostModel.from_dict(old)
    assert model.coefficients == CostCoefficients(0.05, 0.001, 1e-6, 0.0)
    f = step_features([(10, 1)] * 3)
    assert model.predict(f) == pytest.approx(0.05 + 0.003 + 33e-6)
    model.observe(f, 0.2)  # and learns from here with all of its features
    assert len(model.to_dict()["buckets"]["2"]["xy"]) == NUM_FEATURES


def test_the_budget_counts_the_chunk_as_one_more_sequence():
    true = CostCoefficients(overhead_s=0.02, per_token_s=0.001, per_pair_s=0.0, per_seq_s=0.01)
    budget = TpotBudget(StepCostModel(true), target_s=0.2)
    step = step_features([(50, 1)] * 10)  # 0.02 + 0.01 + 0.1 = 0.13 s
    n = budget.chunk_budget(step, 0, 2048)
    assert n == 60  # 0.13 + 0.01 (its sequence) + 0.001 * 60 = 0.2
    assert true.predict(step.plus(0, n)) <= 0.2 < true.predict(step.plus(0, n + 1))


def test_fit_is_never_negative():
    # time falling with tokens (noise, or a machine that got less busy): the fit clamps rather than
    # predicting a negative cost for a big step
    model = StepCostModel()
    for n, t in ((1, 0.05), (8, 0.049), (64, 0.048), (256, 0.047)):
        model.observe(StepFeatures(n, n * 10), t)
    c = model.coefficients
    assert min(c.as_list()) >= 0
    assert model.predict(StepFeatures(4096, 10**7)) > 0


def test_many_small_steps_do_not_wash_out_big_ones():
    """Decode-only steps far outnumber prefill steps; each size bucket keeps its own recent window."""
    rng = random.Random(1)
    model = StepCostModel(window=32)
    for _ in range(40):
        f = step_features([(0, rng.randint(200, 500))])
        model.observe(f, TRUE.predict(f))
    for _ in range(3000):
        f = step_features([(rng.randint(50, 100), 1) for _ in range(rng.randint(20, 30))])
        model.observe(f, TRUE.predict(f) * rng.uniform(0.98, 1.02))
    big = step_features([(0, 400)])
    assert model.predict(big) == pytest.approx(TRUE.predict(big), rel=0.05)


def test_model_file_round_trip(tmp_path):
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(50):
        f = _random_step(rng)
        model.observe(f, TRUE.predict(f))
    path = tmp_path / "cost.json"
    model.save(path, source="test")
    loaded = StepCostModel.load(path)
    assert loaded.coefficients.as_list() == pytest.approx(model.coefficients.as_list())
    assert loaded.num_samples == 50
    f = StepFeatures(300, 100_000)  # it keeps learning from where it was
    model.observe(f, 1.0)
    loaded.observe(f, 1.0)
    assert loaded.coefficients.as_list() == pytest.approx(model.coefficients.as_list())
    # only coefficients: a fixed model
    fixed = StepCostModel.from_dict({"overhead_s": 0.01, "per_token_s": 0.001, "per_pair_s": 0.0})
    assert fixed.predict(StepFeatures(10, 0)) == pytest.approx(0.02)


@pytest.mark.parametrize("text", ["{", "[]", '{"overhead_s": "x", "per_token_s": 0, "per_pair_s": 0}',
                                  '{"overhead_s": -1, "per_token_s": 0, "per_pair_s": 0}'])
def test_bad_model_file_is_one_line(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.json") as e:
        StepCostModel.load(path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="missing.json"):
        StepCostModel.load(tmp_path / "missing.json")


def test_chunk_budget_is_the_largest_chunk_within_the_target():
    budget = TpotBudget(StepCostModel(TRUE), target_s=0.4)
    step = step_features([(500, 1)] * 20)
    for start in (0, 300, 1400):
        n = budget.chunk_budget(step, start, 2048)
        assert TRUE.predict(step.plus(start, n)) <= 0.4 < TRUE.predict(step.plus(start, n + 1))
    assert budget.chunk_budget(step, 0, 7) == 7  # never more than the token budget left
    slow = step_features([(500, 1)] * 300)  # decodes alone already over the target
    assert TRUE.predict(slow) > 0.4 and budget.chunk_budget(slow, 0, 2048) == 0
    with pytest.raises(ValueError, match="target"):
        TpotBudget(StepCostModel(TRUE), 0)


@pytest.mark.parametrize("seed", range(6))
def test_target_never_exceeds_the_budget_nor_starves_a_decode(seed):
    """Random arrivals, a fake clock that a synthetic cost advances, a model learning it online."""
    rng = random.Random(seed)
    target, max_batch = rng.choice([0.15, 0.3, 0.6]), rng.choice([64, 512, 2048])
    cost = CostCoefficients(rng.uniform(0.005, 0.03), rng.uniform(2e-4, 2e-3), rng.uniform(1e-8, 1e-7))
    model = StepCostModel()  # learns from nothing: zero cost until it has seen steps
    cfg = SchedulerConfig(max_batch, max_num_seqs=24, block_size=16, num_blocks=4096)
    s = Scheduler(cfg, BlockPool(4096)).with_prefill_policy(Chunked(max_batch))
    s.with_step_budget(TpotBudget(model, target))
    arrivals = sorted((rng.uniform(0, 20), rng.choice([rng.randint(8, 120), rng.randint(600, 2000)]),
                       rng.randint(1, 40)) for _ in range(60))
    clock, last_token, pending, n = 0.0, {}, list(arrivals), 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= clock:
            _, prompt_len, max_tokens = pending.pop(0)
            s.add_request(f"r{n}", [1] * prompt_len, max_tokens)
            n += 1
        if not s.has_unfinished():
            clock = pending[0][0]
            continue
        ready = {rid for rid in s._requests if s.request(rid).is_decode_ready and rid in last_token}
        predicted_model = model.budget_coefficients
        out = s.schedule()
        assert 0 < out.num_tokens <= max_batch
        assert ready <= set(out.decodes), "a running decode was left out of a step"
        f = step_features((seq.start, len(seq.tokens)) for seq in plan(s, out).batch.seqs)
        if out.decodes and out.chunks:
            assert predicted_model.predict(f) <= target + 1e-12
        duration = cost.predict(f)
        clock += duration
        model.observe(f, duration)
        p = plan(s, out)
        sampled = {rid: 7 for _, rid in p.sample}
        for rid in sampled:
            last_token[rid] = clock
        for rid in s.update(out, sampled):
            last_token.pop(rid)
    assert n == len(arrivals)


def test_scheduler_stats_carry_the_model_while_a_target_is_on():
    model = StepCostModel(TRUE)
    cfg = SchedulerConfig(512, block_size=16, num_blocks=64)
    s = Scheduler(cfg, BlockPool(64)).with_prefill_policy(Chunked(512))
    assert s.stats().cost_coefficients is None  # no target, no cost fields
    s.with_step_budget(TpotBudget(model, 0.2))
    s.add_request("a", [1] * 40, 3)
    out = s.schedule()
    f = step_features((q.start, len(q.tokens)) for q in plan(s, out).batch.seqs)
    predicted = model.predict(f)
    model.observe(f, 0.5)
    stats = s.stats()
    assert stats.step_predicted_s == pytest.approx(predicted) and stats.step_actual_s == 0.5
    assert stats.cost_coefficients == tuple(model.coefficients.as_list()) != tuple(TRUE.as_list())


def test_predictions_follow_a_machine_that_turns_slower_within_steps():
    model = StepCostModel(TRUE)
    case = budget_case(model, decodes=20, context=500, start=0)
    budget, step, before, f = case.budget, case.step, case.chunk, case.features
    for _ in range(3):  # another process takes the cores: every step now takes 1.6x as long
        model.observe(f, 1.6 * model.coefficients.predict(f))
        model.predict(f)  # the engine reads the model every step while a target is on
    assert model.predict(f) >= 1.4 * model.coefficients.predict(f)
    assert budget.chunk_budget(step, 0, 2048) < 0.7 * before
    assert model.drift <= 3.0
    for _ in range(3):  # decode-only steps faster than predicted do not move it
        model.observe(f, 0.5 * model.coefficients.predict(f), planned=False)
        model.predict(f)
    assert model.predict(f) >= 1.4 * model.coefficients.predict(f)
    drifts = []
    for _ in range(30):  # the machine turns faster: the drift falls, slowly, and never below 0.6
        model.observe(f, 0.5 * model.coefficients.predict(f))
        model.predict(f)
        drifts.append(model.drift)
    assert drifts[0] > 1.2 and drifts == sorted(drifts, reverse=True) and 0.6 <= drifts[-1] < 0.7
