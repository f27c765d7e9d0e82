"""The few-row hinge of the step cost model: up to FEW_ROWS rows a step's linears cost more per row (the CPU
few-row kernels), past it the weight's once-a-step cost is paid and a row costs less."""

import random

import pytest

from mixserve.core.cost_model import FEW_ROWS, CostCoefficients, StepCostModel, step_features
from mixserve.core.tpot_budget import TpotBudget

# the shape measured on the default Q4_1 model (docs/decisions/step-cost-few-rows.md): ~2.6 ms a row up to
# 32 rows, ~1.3 ms a row past them
HINGED = CostCoefficients(overhead_s=0.012, per_token_s=0.0013, per_pair_s=5e-7, per_seq_s=0.0002,
                          per_few_row_s=0.0013)


def _step(rng: random.Random):
    decodes = [(rng.randint(30, 1200), 1) for _ in range(rng.randint(0, 24))]
    chunks = [(rng.randint(0, 1200), rng.choice((rng.randint(1, 40), rng.randint(1, 400))))
              for _ in range(rng.randint(0 if decodes else 1, 1))]
    return step_features(decodes + chunks)


def test_fit_recovers_the_hinge_and_predicts_small_and_big_steps():
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(500):
        f = _step(rng)
        model.observe(f, HINGED.predict(f) * rng.uniform(0.99, 1.01))
    got = model.coefficients
    assert got.per_few_row_s == pytest.approx(HINGED.per_few_row_s, rel=0.1)
    assert got.per_token_s == pytest.approx(HINGED.per_token_s, rel=0.1)
    small, big = step_features([(100, 1)] * 8), step_features([(100, 1)] * 8 + [(500, 256)])
    without = model.fit(num_features=5)  # the model before the hinge, on the same steps
    for f in (small, big):
        assert model.predict(f) == pytest.approx(HINGED.predict(f), rel=0.03)
    assert abs(without.predict(small) / HINGED.predict(small) - 1) > 0.1  # a line cannot follow the knee


@pytest.mark.parametrize("seed", range(8))
def test_chunk_budget_is_exact_across_the_knee(seed):
    """The largest chunk within the target, against a search over every length, for steps below, at and
    past the knee (the root is solved per side of it)."""
    rng = random.Random(seed)
    c = CostCoefficients(rng.uniform(0.002, 0.03), rng.uniform(1e-4, 2e-3), rng.uniform(0, 1e-6),
                         rng.uniform(0, 1e-3), rng.uniform(0, 5e-3), rng.uniform(0, 4e-3))
    budget = TpotBudget(StepCostModel(c), target_s=1.0)
    for decodes in (0, 3, FEW_ROWS - 1, FEW_ROWS + 5):
        step = step_features([(200, 1)] * decodes)
        for target in (0.02, 0.08, 0.2, 0.5):
            n = budget.chunk_budget(step, 300, 1024, target)
            fits = [m for m in range(1025) if c.predict(step.plus(300, m)) <= target]
            want = max(fits) if fits and c.predict(step) + c.per_seq_s <= target else 0
            assert n == want, (decodes, target)
