"""The engine's side of the step cost model: it learns from every step's duration, is seeded (only when a
TPOT target is on) by a bounded start-up profile, feeds the scheduler's TpotBudget, and is written to
`[engine] cost_model` on close, for `mixserve simulate`."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from mixserve.core import ForwardBatch, ForwardSeq, Scheduler
from mixserve.core.cost_model import StepCostModel, StepFeatures, step_features
from mixserve.core.slo import SloBudget, step_budget_for

logger = logging.getLogger(__name__)

# The start-up profile stops after this long, whatever it has measured by then: a slow machine gets a
# rougher seed, which the online fit then corrects within a few dozen steps.
PROFILE_BUDGET_S = 6.0
PROFILE_REPEATS = 3


def profile_shapes(max_batch_tokens: int, max_num_seqs: int,
                   max_len: int) -> list[tuple[list[tuple[int, int]], str]]:
    """The steps the profile times: (start, length) per sequence, and a name.

    Decode-only steps, prefill chunks at two starts, and chunks beside decodes, spread over tokens and
    attended pairs. Ordered so that any prefix already spans all three coefficients: on a busy machine the
    time bound may stop it after a few, and a profile of small shapes only fits the per-pair term far too
    high (docs/decisions/step-cost-per-sequence.md).
    """
    decodes = min(16, max_num_seqs - 1)
    rounds = [
        (1, [(63, 1)]), (128, [(0, 128)]), (128, [(1024, 128)]), (8, [(511, 1)] * 8),
        (512, [(0, 512)]), (128 + decodes, [(255, 1)] * decodes + [(0, 128)]), (32, [(63, 1)] * 32),
        (512, [(1024, 512)]), (32, [(0, 32)]), (1024, [(0, 1024)]), (32, [(511, 1)] * 32),
        (512 + decodes, [(255, 1)] * decodes + [(512, 512)]), (2048, [(0, 2048)]), (256, [(0, 256)]),
        (256, [(1024, 256)]), (8, [(63, 1)] * 8), (64, [(0, 64)]), (1024, [(1024, 1024)]),
    ]
    shapes = []
    for tokens, seqs in rounds:
        if tokens <= max_batch_tokens and len(seqs) <= max_num_seqs and seqs and \
                max(start + n for start, n in seqs) <= max_len:
            shapes.append((seqs, " + ".join(sorted({f"{seqs.count(x)} x {x[1]} at {x[0]}" for x in seqs}))))
    return shapes


def profile(runner: Any, model: StepCostModel, block_ids: list[int], max_batch_tokens: int,
            max_num_seqs: int, budget_s: float = PROFILE_BUDGET_S) -> int:
    """Time forwards of synthetic steps on `block_ids` (scratch: no request holds them yet) and teach
    `model`; not through the step trace. Returns the steps timed."""
    bs = runner.block_size
    deadline = time.monotonic() + budget_s
    timed = 0
    next_block = 0

    def table(upto: int) -> list[int]:
        nonlocal next_block
        need = -(-upto // bs)
        out = [block_ids[(next_block + i) % len(block_ids)] for i in range(need)]
        next_block += need
        return out

    shapes = profile_shapes(max_batch_tokens, max_num_seqs, getattr(runner, "max_model_len", 1 << 30))
    for seqs, _name in shapes:
        batch = ForwardBatch([ForwardSeq(f"profile-{j}", [1] * n, start, table(start + n))
                              for j, (start, n) in enumerate(seqs)])
        f = step_features(seqs)
        # the first forward of a shape is not timed: kernels pick and pack per shape (oneDNN), which the
        # engine pays once per shape, not per step; of the others the fastest counts, as a busy machine
        # only adds time (the drift then scales predictions while it lasts)
        times = []
        for _ in range(PROFILE_REPEATS + 1):
            if time.monotonic() > deadline:
                break
            t0 = time.monotonic()
            _sync(runner.forward(batch))
            times.append(time.monotonic() - t0)
        if len(times) > 1:
            model.observe(f, min(times[1:]))
            timed += 1
        if time.monotonic() > deadline:
            return timed
    return timed


def _sync(logits: Any) -> None:
    """Wait for the device (a CUDA forward returns before it has run)."""
    if hasattr(logits, "sum"):
        logits.sum().item()


class StepCost:
    """The cost model of one engine, and the step budget when a TPOT target or an SLO is set."""

    def __init__(self, cfg: Any, runner: Any, scheduler: Scheduler, num_blocks: int) -> None:
        self.path = cfg.cost_model
        # a model written by an earlier run is its seed; it then goes on learning from this run's steps
        self.model = StepCostModel.load(self.path) if self.path and Path(self.path).exists() \
            else StepCostModel()
        self.budget = step_budget_for(self.model, cfg.tpot_target_ms, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
        self.target_s = cfg.tpot_target_ms / 1000.0  # what the cost model file records
        self._features = StepFeatures()
        self._predicted: float | None = None
        self._planned = False
        self.profiled = 0
        if self.budget is not None:
            if self.model.num_samples == 0:
                start = time.monotonic()
                # at start-up no request holds a block: the top of the pool is scratch
                scratch = list(range(max(0, num_blocks - 2048), num_blocks))
                self.profiled = profile(runner, self.model, scratch, cfg.max_batch_tokens, cfg.max_num_seqs)
                logger.info("step cost profile: %d steps in %.1f s -> %s", self.profiled,
                            time.monotonic() - start, self.model.coefficients)
            scheduler.with_step_budget(self.budget, cfg.waiting_share)

    def begin(self, batch: ForwardBatch) -> None:
        """The step about to run: its features, and (target on) its predicted time."""
        self._features = step_features((s.start, len(s.tokens)) for s in batch.seqs)
        # a step the budget sized: decodes (one token) beside a chunk (a one-token chunk counts as a decode)
        lengths = {len(s.tokens) == 1 for s in batch.seqs}
        self._planned = lengths == {True, False}
        self._predicted = self.model.predict(self._features) if self.budget is not None else None

    def end(self, duration_s: float) -> dict:
        """Learn from the step that just ran; returns the step trace's cost fields."""
        self.model.observe(self._features, duration_s, planned=self._planned)
        if self._predicted is None:
            return {}
        fields = {"predicted_s": self._predicted, "cost_model": self.model.coefficients.as_list(),
                  "drift": self.model.drift, "margin": self.model.step_drift.margin}
        if isinstance(self.budget, SloBudget):  # the SLO mode's limit for this step, and mixed or exclusive
            limit = self.budget.target_s
            fields.update(slo_limit_s=None if math.isinf(limit) else limit, mode=self.budget.mode)
        return fields

    @property
    def last_predicted_s(self) -> float | None:
        return self._predicted

    def save(self) -> None:
        """Write the model to `[engine] cost_model` (nothing when that is empty)."""
        if not self.path:
            return
        try:
            self.model.save(self.path, source="serve", target_ms=self.target_s * 1000)
        except OSError as e:
            logger.warning("cannot write the cost model to %s: %s", self.path, e.strerror)
