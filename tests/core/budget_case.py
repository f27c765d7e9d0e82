"""A step of decodes that a TPOT budget fills with one chunk: the setup the budget tests share."""

from __future__ import annotations

from dataclasses import dataclass

from mixserve.core.cost_model import StepCostModel, StepFeatures, step_features
from mixserve.core.tpot_budget import TpotBudget


@dataclass
class BudgetCase:
    budget: TpotBudget
    step: StepFeatures  # the decodes alone
    start: int  # where the chunk starts in its prompt
    chunk: int  # the chunk the budget gave when the case was built
    features: StepFeatures  # the decodes and that chunk


def budget_case(model: StepCostModel, *, decodes: int, context: int, start: int,
                target_s: float = 0.4) -> BudgetCase:
    """`decodes` sequences at `context` under a `target_s` budget, and the chunk it fills them with."""
    budget = TpotBudget(model, target_s)
    step = step_features([(context, 1)] * decodes)
    chunk = budget.chunk_budget(step, start, 2048)
    return BudgetCase(budget, step, start, chunk, step.plus(start, chunk))
