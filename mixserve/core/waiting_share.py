"""Under a TPOT target, the share of a step's time that waiting prompts may take before the prompts
part-way through their prefill, so that a short prompt is not held behind every chunk of a long one.

Why a share, and why this one. Without it (the scheduler's phases 2 then 3) a prompt mid-prefill takes the
step's whole time budget before a waiting prompt is looked at: under a target a 1,500-token prompt spans
about nine steps, and a short prompt arriving meanwhile waits for all of them (workload M: short TTFT p99
4.6 s, p50 1.3 s). Letting waiting prompts go first without a bound is no better an answer: every token
prefilled ahead of the long prompt delays its first token by exactly that token's time, and on M the short
prompts are a quarter of the work (2 a second, 32-128 tokens each), so shortest-first makes the long prompts
1.22x slower (simulated, six seeds of M) and moves them further from the issue's bound (within 1.25x of
whole prompts' TTFT; the target without a share is at 1.34x in the same simulation, 1.29x measured).

The rule: in a step that holds decodes, waiting prompts, in arrival order, may start before the partial
prefills when each fits whole (its entire prompt, no chunk of it) within `[engine] waiting_share`
(WAITING_SHARE, 0.15, by default) of the step's chunk time (target minus the decodes' predicted time). A
prompt that does not fit keeps its place for phase 3 and those behind it may pass it, as prefill_limits'
SKIP. Partial prefills therefore always get at least (1 - share) of the chunk time, so their prefill is at
most 1 / (1 - share) slower in the worst case (1.18x at 0.15). Without decodes in the step nothing is sized
by the target and the share does not apply; with the target off the scheduler never builds one (share 0
replays M exactly as the scheduler before it did).

Why 0.15. Simulated on M (six seeds, on three measured cost models: full-M-6's budget-256 run 3 and target
run 2, full-M-5's target run 2, bench/results/tpot-target/*/steps), with the scheduler's rule that a step
ending a prefill takes nothing after it, share 0 / 0.1 / 0.15 / 0.2 / 0.25 give the long prompts a TTFT p50
of 1834 / 1845 / 1878 / 1941 / 1984 ms on budget 256's model (whole prompts at 2048: 1622, budget 256: 2040)
and the short prompts a mean TTFT of 442 / 425 / 395 / 342 / 316 ms (their p99, ~2 s, moves only from 0.2
up: a prompt over the share still waits for the long one). 0.15 buys 11% of the short prompts' mean for 2%
of the long prompts' TTFT; 0.25, the default before, cost the long prompts 8% and put them at 1.22-1.25x
whole prompts' TTFT on the three models, on the issue's bound (1.25x), where 0.15 keeps them at 1.15-1.19x.
"""

from __future__ import annotations

from mixserve.core.cost_model import StepFeatures, TpotBudget

WAITING_SHARE = 0.15  # EngineConfig.waiting_share's default


class WaitingShare:
    """What waiting prompts may still take of one step's time before the partial prefills get theirs."""

    def __init__(self, budget: TpotBudget, decodes: StepFeatures, share: float = WAITING_SHARE) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the waiting prompts' share must be within 0..1, got {share!r}")
        self.coefficients = budget.model.budget_coefficients  # as the TpotBudget plans the step
        self._features = decodes
        decodes_s = self.coefficients.predict(decodes)
        self.limit_s = decodes_s + share * max(0.0, budget.target_s - decodes_s)

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
