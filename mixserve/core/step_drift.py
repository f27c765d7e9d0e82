"""How far the machine runs from the step cost model's fit right now: the drift (the recent average of
measured / predicted, which scales every prediction) and the spread (how far single steps still run over
that, which the TPOT budget leaves room for). Both learn from planned steps only: decodes beside a chunk,
the steps the budget sizes.

The drift rises faster (0.5) than it falls (0.3), within 0.6..3. The budget plans each step to its p90
time: the fit times the drift times `margin`, the 0.9 quantile of the last 128 planned steps' measured /
predicted ratios (1 until 8 are known, within 1..1.5); the first 8 planned steps after start-up teach the
drift only. Why these numbers, measured on recorded runs: docs/decisions/step-drift-and-p90-margin.md.
"""

from __future__ import annotations

from collections import deque

DRIFT_UP, DRIFT_DOWN = 0.5, 0.3
DRIFT_RANGE = (0.6, 3.0)
SPREAD_QUANTILE = 0.9
SPREAD_WINDOW = 128
SPREAD_MIN_STEPS = 8
SPREAD_WARMUP = 8  # planned steps after start-up that teach the drift only
SPREAD_RANGE = (1.0, 1.5)


class StepDrift:
    """The drift (`factor`) and the spread (`margin`) of planned steps, learnt step by step."""

    def __init__(self) -> None:
        self.factor = 1.0
        self._residuals: deque[float] = deque(maxlen=SPREAD_WINDOW)
        self._planned = 0  # planned steps seen

    def observe(self, ratio_to_fit: float) -> None:
        """One planned step's measured / fit ratio (the fit's prediction without the drift)."""
        self.observe_residual(ratio_to_fit / self.factor)  # how far it ran over what was expected of it
        ratio = min(max(ratio_to_fit, DRIFT_RANGE[0]), DRIFT_RANGE[1])
        self.factor += (DRIFT_UP if ratio > self.factor else DRIFT_DOWN) * (ratio - self.factor)

    def observe_residual(self, ratio_to_prediction: float) -> None:
        """A planned step's measured / predicted ratio, for the spread alone (`mixserve simulate --noise`,
        whose drawn ratios are already what a drift left over)."""
        self._planned += 1
        if self._planned > SPREAD_WARMUP:
            self._residuals.append(ratio_to_prediction)

    @property
    def margin(self) -> float:
        """The factor the budget plans with beyond the drift: the spread's upper quantile."""
        if len(self._residuals) < SPREAD_MIN_STEPS:
            return 1.0
        s = sorted(self._residuals)
        q = s[min(len(s) - 1, int(SPREAD_QUANTILE * len(s)))]
        return min(max(q, SPREAD_RANGE[0]), SPREAD_RANGE[1])
