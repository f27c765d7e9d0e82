"""The cost model's nonnegative least squares: a warm start from the last fit's features gives the same
coefficients as the search over every subset, whatever the hint, and refits do not search every step."""

from __future__ import annotations

import random

import pytest

from mixserve.core import least_squares
from mixserve.core.cost_model import StepCostModel, step_features
from mixserve.core.least_squares import nonnegative_fit


def normal_equations(rng: random.Random, n: int) -> tuple[list[list[float]], list[float], float]:
    """X'X, X'y, y'y of a random problem whose true coefficients have some negatives (some held at 0)."""
    truth = [rng.uniform(-1, 2) for _ in range(n)]
    rows = [[rng.uniform(0, 3) for _ in range(n)] for _ in range(4 * n)]
    ys = [sum(a * b for a, b in zip(r, truth, strict=True)) + rng.gauss(0, 0.1) for r in rows]
    xx = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    xy = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    return xx, xy, sum(y * y for y in ys)


@pytest.mark.parametrize("seed", range(40))
def test_a_warm_start_finds_the_exhaustive_fit_whatever_the_hint(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    xx, xy, yy = normal_equations(rng, n)
    want = nonnegative_fit(xx, xy, yy)
    right = tuple(i for i, v in enumerate(want) if v > 0)
    wrong = tuple(sorted(rng.sample(range(n), rng.randint(0, n))))
    for hint in (right, wrong, (), tuple(range(n))):
        got = nonnegative_fit(xx, xy, yy, hint)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (hint, got, want)


def test_refits_after_each_step_solve_once_when_the_features_kept_are_unchanged(monkeypatch) -> None:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(300):
        decodes = [(rng.randint(0, 400), 1) for _ in range(rng.randint(1, 8))]
        f = step_features([*decodes, (0, rng.randint(16, 256))])
        model.observe(f, 0.008 + 0.001 * f.num_tokens + rng.uniform(0, 0.002))
    first = model.coefficients  # the first fit searches the subsets
    solves = []
    real = least_squares._solve
    monkeypatch.setattr(least_squares, "_solve", lambda a, b: solves.append(1) or real(a, b))
    f = step_features([(100, 1)])
    for _ in range(10):
        model.observe(f, 0.009)
        again = model.coefficients
    assert len(solves) <= 10 + 2 ** 6  # one a refit, a search at most once (searching each: 630)
    assert again.per_token_s == pytest.approx(first.per_token_s, rel=0.2)
