"""The step budget under a TPOT target: how long a chunk may be so that the step's predicted time stays within
the target, on the step cost model's coefficients (core/cost_model.py)."""

from __future__ import annotations

import math

from mixserve.core.cost_model import FEW_ROWS, CostCoefficients, StepCostModel, StepFeatures


class TpotBudget:
    """The step budget under a TPOT target: a chunk may fill the step until its predicted time reaches it.

    The scheduler asks only while decodes run in the step (no decodes, nothing to protect: the plain
    budget). Decodes are scheduled before any chunk, so they are never cut; a decode-only step already
    over the target gets no chunk at all.
    """

    def __init__(self, model: StepCostModel, target_s: float) -> None:
        if not target_s > 0:
            raise ValueError(f"the TPOT target must be > 0 s, got {target_s!r}")
        self.model = model
        self.target_s = target_s

    def stats(self) -> dict:
        """SchedulerStats' cost fields: the last step's predicted and measured time, the coefficients."""
        m = self.model
        return {"step_predicted_s": m.last_predicted_s, "step_actual_s": m.last_actual_s,
                "cost_coefficients": tuple(m.coefficients.as_list()), "cost_drift": m.drift,
                "cost_margin": m.step_drift.margin}

    def planning_coefficients(self) -> CostCoefficients:
        """What steps are planned with: the fit times the drift and the spread's margin (a p90 step)."""
        return self.model.budget_coefficients

    def chunk_budget(self, step: StepFeatures, start: int, budget_left: int,
                     target_s: float | None = None) -> int:
        """The largest chunk length <= budget_left, at positions `start ..`, that keeps the step's
        predicted time within the target (or `target_s`; 0 if even one token would not)."""
        c, target_s = self.planning_coefficients(), self.target_s if target_s is None else target_s
        if math.isinf(target_s):
            return max(0, budget_left)
        time_left = target_s - c.predict(step) - c.per_seq_s  # the chunk is one more sequence
        if time_left < 0 or budget_left <= 0:
            return 0
        # c.tok*L + c.pair*(L*start + L(L+1)/2) <= time_left: a quadratic increasing in L, solved first
        # past the few-row hinge (its whole rest charged), then below it if the step stays under it
        a, b = c.per_pair_s / 2, c.per_token_s + c.per_pair_s * (start + 0.5)
        few_left = FEW_ROWS - step.num_few_rows
        length = _root(a, b, time_left - c.per_few_row_s * few_left)
        if length < few_left:
            length = min(_root(a, b + c.per_few_row_s, time_left), few_left)
        if math.isinf(length):
            return budget_left
        n = min(budget_left, max(0, math.floor(length)))
        # the float root may be one off either way: settle it on the exact prediction
        while n < budget_left and c.predict(step.plus(start, n + 1)) <= target_s:
            n += 1
        while n > 0 and c.predict(step.plus(start, n)) > target_s:
            n -= 1
        return n


def _root(a: float, b: float, time_left: float) -> float:
    """The largest L >= 0 with a*L^2 + b*L <= time_left (a, b >= 0; inf when both are 0)."""
    if time_left < 0:
        return 0.0
    if a > 0:
        return (-b + math.sqrt(b * b + 4 * a * time_left)) / (2 * a)
    return time_left / b if b > 0 else math.inf
