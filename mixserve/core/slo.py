"""Serving to an SLO: TTFT and TPOT targets instead of a fixed step target.

Each step the budget takes its time limit from the slack of the running requests: a decode may spend what
it has saved over its TPOT SLO, spread over the tokens it still has to make, so the step limit is the
smallest of those shares (a request ahead of its SLO lends time, one behind it takes less). Without a
prompt whose TTFT is at risk a step stays within STEP_CAP_TPOTS of the TPOT SLO; with one at risk the
decodes' whole share goes to the chunks. A request that can no longer meet its SLO even with the fastest
steps is given up on: counted, still served, but no longer protected (a TPOT one no longer limits the
step, a TTFT one waits behind the prompts that can still make theirs). Waiting prompts go in order of
TTFT deadline (arrival, as every request has the same SLO), given-up ones last, except that one waiting
longer than WAIT_BOUND_TTFTS TTFT SLOs goes first: nobody starves. Per step the budget also chooses
between one mixed step and a decode-only step followed by a prefill-only one (`exclusive`), whichever
prefills more in the same time; every PROBE_EVERY-th such choice runs mixed anyway, as the cost of a
decode beside a chunk is learnt only from mixed steps. A mixed step may also be stretched to the time of k
paced steps, the k - 1 after it decode-only, where the cost model's few-row hinge makes that prefill more
(`_stretch`). Decodes are paced at PACE of their TPOT SLO, so a step slower than predicted does not tip
them over it. Why: docs/decisions/serving-to-an-slo.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from mixserve.core.cost_model import CostCoefficients, StepCostModel, StepFeatures, step_features
from mixserve.core.request import Request
from mixserve.core.tpot_budget import TpotBudget

STEP_CAP_TPOTS = 2.0  # no TTFT at risk: a step lasts at most this many TPOT SLOs, however much slack
TTFT_RISK = 2.0  # a prompt is at risk once twice its prefill's time alone would pass its TTFT deadline
WAIT_BOUND_TTFTS = 10.0  # a request waiting this many TTFT SLOs is admitted first, given up on or not
PACE = 0.9  # the step limit paces decodes at this fraction of the TPOT SLO: one slow step stays inside it
PROBE_EVERY = 8  # after this many exclusive choices in a row one mixed step runs: the fit keeps seeing them
MAX_STRETCH = 4  # a stretched step takes the time of at most this many paced steps, the rest decode-only
STRETCH_GAIN = 1.1  # and only for this much more prefill per paced step: its arrivals wait the longer step


@dataclass(frozen=True)
class SloTargets:
    """The service level, in seconds: first token within ttft_s, mean time per output token within
    tpot_s; 0 = no target of that kind (at least one is set)."""

    ttft_s: float = 0.0
    tpot_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s)):
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"SLO {name} must be a finite number >= 0, got {v!r}")
        if not (self.ttft_s or self.tpot_s):
            raise ValueError("an SLO needs a TTFT or a TPOT target > 0")

    @property
    def wait_bound_s(self) -> float:
        """Waiting longer than this, a request goes before every other (inf without a TTFT target:
        the queue then keeps arrival order and nobody is passed)."""
        return WAIT_BOUND_TTFTS * self.ttft_s if self.ttft_s else math.inf


@dataclass
class SloCounts:
    """Since the scheduler was built: requests given up on per SLO, and steps run exclusive."""

    given_up_ttft: int = 0
    given_up_tpot: int = 0
    exclusive_steps: int = 0  # decode-only steps chosen over a mixed one, each then a prefill-only one
    stretched_steps: int = 0  # mixed steps given the time of k paced steps, then k - 1 decode-only ones


class SloBudget(TpotBudget):
    """The step budget of the SLO mode: `target_s` is set anew by every `begin_step` (inf: no limit)."""

    def __init__(self, model: StepCostModel, targets: SloTargets,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(model, math.inf)
        self.targets, self.clock = targets, clock
        self.counts = SloCounts()
        self.now = 0.0
        self.decode_s = 0.0  # the running decodes' predicted time, one token each
        self.ttft_at_risk = False
        self.mode = "mixed"  # the last step's: mixed | decode-only | prefill-only
        self._exclusive_run = 0  # exclusive choices since the last mixed step with decodes and a chunk
        self.cap_s = math.inf  # this step's cap, whatever the decodes' slack
        self._repay = 0  # decode-only steps still owed after a stretched step

    def planning_coefficients(self) -> CostCoefficients:
        # the fit times the drift, without the spread's margin: slack is kept on measured times, so a
        # step that runs over only shrinks the limits of the steps after it
        c, d = self.model.coefficients, self.model.drift
        return c if d == 1.0 else CostCoefficients(*(x * d for x in c.as_list()))

    # ---- per request -------------------------------------------------------------------------------

    def arrived(self, r: Request) -> None:
        r.arrival_s = self.clock()

    def sampled(self, r: Request) -> None:
        if r.first_token_s is None:
            r.first_token_s = self.clock()

    def per_token_s(self, r: Request, now: float, pace: float = 1.0) -> float:
        """The time each of a decoding request's remaining tokens may take and still meet `pace` times
        the TPOT SLO on average (its max_tokens taken as its length: an early EOS only leaves it more)."""
        first = r.first_token_s if r.first_token_s is not None else now
        left = max(1, r.max_tokens - r.num_generated)
        return (first + (r.max_tokens - 1) * pace * self.targets.tpot_s - now) / left

    def ttft_deadline(self, r: Request) -> float:
        return r.arrival_s + self.targets.ttft_s

    def _give_up(self, r: Request, which: str) -> None:
        if not r.slo_given_up:
            r.slo_given_up = True
            setattr(self.counts, f"given_up_{which}", getattr(self.counts, f"given_up_{which}") + 1)

    # ---- per step ----------------------------------------------------------------------------------

    def begin_step(self, running: Sequence[Request], waiting: Iterable[Request],
                   prefill_only: bool = False) -> list[Request]:
        """Set this step's time limit from the requests' slack, give up on the hopeless; returns the
        waiting requests in the order to admit them. `prefill_only`: the decodes just ran apart."""
        now = self.now = self.clock()
        c = self.planning_coefficients()
        decodes = [r for r in running if not r.is_prefilling and r.first_token_s is not None]
        self.decode_s = c.predict(step_features((len(r.tokens) - 1, 1) for r in decodes)) if decodes else 0.0
        limit = math.inf
        if self.targets.tpot_s > 0:
            for r in decodes:
                if self.per_token_s(r, now) < self.decode_s and not r.slo_given_up:
                    self._give_up(r, "tpot")  # even decode-only steps could not catch up
                if not r.slo_given_up:  # paced under the SLO, but never below a decode-only step
                    limit = min(limit, max(self.per_token_s(r, now, PACE), self.decode_s))
        waiting = list(waiting)
        self.ttft_at_risk = False
        if self.targets.ttft_s > 0:
            for r in (*(r for r in running if r.is_prefilling), *waiting):
                self._check_ttft(r, now, c)
        tpot = self.targets.tpot_s
        self.cap_s = cap = math.inf if self.ttft_at_risk or not tpot else STEP_CAP_TPOTS * tpot
        self.target_s = min(limit, cap) - (self.decode_s if prefill_only else 0.0)
        self.mode = "prefill-only" if prefill_only else "mixed"
        if self._repay and decodes and not prefill_only:  # after a stretched step: the decodes alone
            self._repay -= 1
            self.target_s, self.mode = min(self.target_s, self.decode_s), "decode-only"
        return self.ordered(waiting)

    def _check_ttft(self, r: Request, now: float, c: CostCoefficients) -> None:
        """Give up on a prompt whose prefill alone would end past its TTFT deadline; flag one at risk."""
        if r.first_token_s is not None or r.slo_given_up:
            return
        end = r.prefill_end if r.prefill_end > r.num_computed else len(r.tokens)
        alone_s = c.predict(StepFeatures().plus(r.num_computed, end - r.num_computed))
        time_left = self.ttft_deadline(r) - now
        if alone_s > time_left:
            self._give_up(r, "ttft")
        elif TTFT_RISK * alone_s > time_left:
            self.ttft_at_risk = True

    def protected(self, r: Request) -> bool:
        """Still served to its SLO: not given up on, or waiting past the bound (then before all)."""
        return not r.slo_given_up or self.overdue(r)

    def overdue(self, r: Request) -> bool:
        """Waiting past the bound: it goes before every other request."""
        return self.now - r.arrival_s > self.targets.wait_bound_s

    def ordered(self, requests: Iterable[Request]) -> list[Request]:
        """Earliest TTFT deadline first, given-up requests after the others, any request waiting past the
        bound before all (a stable sort: equal keys keep the queue's order, preempted ones in front)."""
        bound, now = self.targets.wait_bound_s, self.now

        def key(r: Request) -> tuple[int, float]:
            tier = 0 if now - r.arrival_s > bound else 2 if r.slo_given_up else 1
            return tier, r.arrival_s

        return sorted(requests, key=key)

    def exclusive(self, decodes: StepFeatures, start: int, budget_left: int) -> bool:
        """Run the decodes alone now and the chunk (at positions `start ..`) alone next, instead of one
        mixed step? Yes when that prefills more tokens within the same time limit (with no limit: when
        the two steps together are predicted shorter than the mixed one)."""
        if budget_left < 1:
            return False
        c = self.planning_coefficients()
        if math.isinf(self.target_s):
            chunk = StepFeatures().plus(start, budget_left)
            split = c.predict(decodes) + c.predict(chunk) < c.predict(decodes.plus(start, budget_left))
        else:
            mixed = self.chunk_budget(decodes, start, budget_left)
            alone = self.chunk_budget(StepFeatures(), start, budget_left, self.target_s - c.predict(decodes))
            split = alone > mixed
        if split and self._exclusive_run >= PROBE_EVERY - 1:
            split = False  # a probe: the per-mixed-decode term is learnt only from mixed steps
        self._exclusive_run = self._exclusive_run + 1 if split else 0
        if split:
            self.counts.exclusive_steps += 1
            self.mode = "decode-only"
        elif self.mode == "mixed":
            self._stretch(decodes, start, budget_left, c)
        return split

    def _stretch(self, decodes: StepFeatures, start: int, budget_left: int, c: CostCoefficients) -> None:
        """Give this step the time of k paced steps less k - 1 decode-only ones after it, for the k that
        prefills most per paced step, if more than one (the CPU's fixed cost of a step past the few-row
        kernels is then paid once, not k times)."""
        if math.isinf(self.target_s):
            return
        one = self.chunk_budget(decodes, start, budget_left)
        best, best_k, best_s = float(one), 1, self.target_s
        for k in range(2, MAX_STRETCH + 1):
            stretched_s = min(k * self.target_s - (k - 1) * c.predict(decodes), self.cap_s)
            n = self.chunk_budget(decodes, start, budget_left, stretched_s)
            if n / k > STRETCH_GAIN * best:
                best, best_k, best_s = n / k, k, stretched_s
        if best_k > 1:
            self.target_s, self._repay, self.mode = best_s, best_k - 1, "stretched"
            self.counts.stretched_steps += 1

    def stats(self) -> dict:
        """SchedulerStats' fields: the cost model's, the counts, this step's limit and mode."""
        limit = None if math.isinf(self.target_s) else self.target_s
        return {**super().stats(), **{f"slo_{k}": v for k, v in asdict(self.counts).items()},
                "slo_step_limit_s": limit, "slo_mode": self.mode}


def step_budget_for(model: StepCostModel, tpot_target_ms: float, slo_ttft_ms: float = 0,
                    slo_tpot_ms: float = 0, clock: Callable[[], float] = time.monotonic) -> TpotBudget | None:
    """The step budget the config asks for: the SLO mode when an SLO is set (its TPOT the target's when
    only a TTFT SLO is), else the TPOT target, else None (every step gets max_batch_tokens)."""
    if slo_ttft_ms > 0 or slo_tpot_ms > 0:
        targets = SloTargets(slo_ttft_ms / 1000.0, (slo_tpot_ms or tpot_target_ms) / 1000.0)
        return SloBudget(model, targets, clock)
    return TpotBudget(model, tpot_target_ms / 1000.0) if tpot_target_ms > 0 else None


def first_prefill(prefilling: Sequence[Request], waiting: Sequence[Request]) -> tuple[int, int] | None:
    """(start, tokens left) of the prompt the next chunk would go to, None if none waits."""
    for r in prefilling:
        return r.num_computed, r.prefill_end - r.num_computed
    for r in waiting:
        return 0, len(r.tokens)
    return None
