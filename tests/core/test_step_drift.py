"""The spread's margin: the budget plans each step to its upper-quantile time, learnt from planned steps."""

from __future__ import annotations

import pytest

from mixserve.core.cost_model import CostCoefficients, StepCostModel, step_features
from mixserve.core.step_drift import SPREAD_MIN_STEPS, SPREAD_RANGE, SPREAD_WARMUP, SPREAD_WINDOW, StepDrift
from tests.core.budget_case import budget_case

TRUE = CostCoefficients(overhead_s=0.03, per_token_s=0.001, per_pair_s=5e-7, per_seq_s=0.0005)


def warmed() -> StepDrift:
    """A drift past its start-up steps (which teach the drift only)."""
    d = StepDrift()
    for _ in range(SPREAD_WARMUP):
        d.observe_residual(1.45)
    assert d.margin == 1.0
    return d


def test_margin_is_one_until_enough_steps_then_their_upper_quantile():
    d = warmed()
    for _ in range(SPREAD_MIN_STEPS - 1):
        d.observe_residual(1.3)
    assert d.margin == 1.0  # too few steps to say anything
    d.observe_residual(1.3)
    assert d.margin == pytest.approx(1.3)
    d = warmed()
    ratios = [1.0 + i / 100 for i in range(100)]  # 1.00 .. 1.99
    for r in ratios:
        d.observe_residual(r)
    assert d.margin == SPREAD_RANGE[1]  # p90 is 1.90: capped
    d = warmed()
    for r in ratios:
        d.observe_residual(0.8 + 0.4 * (r - 1.0))  # 0.80 .. 1.196
    assert d.margin == pytest.approx(0.8 + 0.4 * 0.90)
    for _ in range(SPREAD_WINDOW):  # a machine that turned quiet: the window forgets the old spread
        d.observe_residual(0.9)
    assert d.margin == SPREAD_RANGE[0]  # never below 1: the drift, not the margin, follows a fast machine


def test_the_drift_catching_up_after_start_up_is_no_spread():
    """Served steps run ~1.3x the start-up profile's fastest-of-repeats: the drift climbs over a few steps,
    and the steps it lags behind are not taken for the machine's spread (full-M-9 r2, full-M-10 r2)."""
    d = StepDrift()
    for _ in range(40):
        d.observe(1.35)  # steady, only slower than the profile said
    assert d.factor == pytest.approx(1.35, rel=1e-3)
    assert d.margin == pytest.approx(1.0, abs=1e-3)


def test_the_residual_is_measured_against_the_drifted_prediction():
    d = StepDrift()
    for _ in range(SPREAD_WINDOW + 20):  # the machine runs steadily 1.5x the fit: the drift takes it all in
        d.observe(1.5)
    assert d.factor == pytest.approx(1.5, rel=1e-3)
    assert d.margin == pytest.approx(1.0, abs=1e-3)  # what is left over it is no spread


def test_the_budget_plans_with_the_margin_and_predictions_stay_the_mean():
    model = StepCostModel(TRUE)
    case = budget_case(model, decodes=10, context=300, start=500)
    budget, step, before, f = case.budget, case.step, case.chunk, case.features
    expected = model.predict(f)
    for _ in range(SPREAD_WARMUP + SPREAD_MIN_STEPS):
        model.step_drift.observe_residual(1.2)
    assert model.step_drift.margin == pytest.approx(1.2)
    assert model.predict(f) == pytest.approx(expected)  # the trace's predicted_s: the expected time
    after = budget.chunk_budget(step, 500, 2048)
    assert 0 < after < before
    planned = model.coefficients.predict(step.plus(500, after)) * model.drift
    assert 1.2 * planned <= 0.4 + 1e-12 < 1.2 * model.coefficients.predict(step.plus(500, after + 1))


def test_the_engine_rule_feeds_the_spread_from_planned_steps_only():
    model = StepCostModel(TRUE)
    f = step_features([(300, 1)] * 4 + [(0, 200)])
    for i in range(40):
        model.predict(f)
        model.observe(f, TRUE.predict(f) * (1.4 if i % 10 == 0 else 1.0), planned=False)
    assert model.step_drift.margin == 1.0  # decode-only or prefill-only steps teach the fit, not the spread
    for i in range(40):
        model.predict(f)
        model.observe(f, model.coefficients.predict(f) * (1.3 if i % 4 == 0 else 1.0))
    assert model.step_drift.margin > 1.05
