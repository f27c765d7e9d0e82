"""Under a TPOT target, the share of a step's time that waiting prompts may take before the prompts
part-way through their prefill, so that a short prompt is not held behind every chunk of a long one.

The rule: in a step that holds decodes, waiting prompts, in arrival order, may start before the partial
prefills when each fits whole (its entire prompt, no chunk of it) within `[engine] waiting_share`
(WAITING_SHARE, 0.15, by default) of the step's chunk time (target minus the decodes' predicted time). A
prompt that does not fit keeps its place for phase 3 and those behind it may pass it, as prefill_limits'
SKIP. Partial prefills therefore always get at least (1 - share) of the chunk time, so their prefill is at
most 1 / (1 - share) slower in the worst case (1.18x at 0.15). Without decodes in the step nothing is sized
by the target and the share does not apply; with the target off the scheduler never builds one (share 0
schedules as the scheduler did before it). Why a share, and why 0.15: docs/decisions/waiting-share.md.
"""

from __future__ import annotations

from mixserve.core.cost_model import StepFeatures
from mixserve.core.tpot_budget import TpotBudget

WAITING_SHARE = 0.15  # EngineConfig.waiting_share's default


class WaitingShare:
    """What waiting prompts may still take of one step's time before the partial prefills get theirs."""

    def __init__(self, budget: TpotBudget, decodes: StepFeatures, share: float = WAITING_SHARE) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the waiting prompts' share must be within 0..1, got {share!r}")
        self.coefficients = budget.planning_coefficients()  # as the budget plans the step
        self._features = decodes
        decodes_s = self.coefficients.predict(decodes)
        self.limit_s = decodes_s + share * max(0.0, budget.target_s - decodes_s)  # inf: no limit

    def take(self, prompt_len: int, budget_left: int) -> bool | None:
        """True, and counted as taken, if a waiting prompt of `prompt_len` tokens fits whole in the share
        and in the `budget_left` tokens (cached blocks are not counted off: a cached prefix only shortens
        the chunk, so a prompt that fits uncached fits); None when not even a one-token prompt would: the
        scheduler stops looking (a long queue is not scanned every step for nothing)."""
        if budget_left < 1 or self.coefficients.predict(self._features.plus(0, 1)) > self.limit_s:
            return None
        if prompt_len > budget_left:
            return False
        f = self._features.plus(0, prompt_len)
        if self.coefficients.predict(f) > self.limit_s:
            return False
        self._features = f
        return True
