"""`mixserve simulate`: replay a workload through the real Scheduler on a fake clock that a step cost model
advances: no weights, no HTTP, seconds instead of minutes. The report is the bench's own (report.py), so a
simulated run and a measured one compare line by line.

The only module of the bench that imports the engine's core (pure Python): the scheduler being simulated.
What it models: each step's duration as the cost model predicts it, sequences included (a step's sampling and
detokenizing is per row). What it leaves out, deliberately: the time between two steps, the HTTP stream, and a
machine whose speed changes mid-run (the engine's drift): the replay runs at the fit's speed throughout (how
much that leaves out of a real run: docs/decisions/step-cost-per-sequence.md). With `noise`
(bench/step_noise.py: a machine's measured step-time spread) each step's time is the model's times a measured
ratio, walked from a seeded point: the replay then stalls as often as a noisy machine would, which the fit
alone never does. A `--profile` model times forwards only, not sampling and detokenizing; a model written by
`serve` on shutdown times whole steps and is the one to replay a run with.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mixserve.bench.report import RequestResult
from mixserve.bench.step_noise import StepNoise
from mixserve.bench.trace import StepRecord
from mixserve.bench.workload import RequestSpec
from mixserve.config import EngineConfig
from mixserve.core import BlockPool, Chunked, Scheduler, SchedulerConfig, WholePrompt, plan
from mixserve.core.cost_model import CostCoefficients, StepCostModel, step_features
from mixserve.core.slo import step_budget_for
from mixserve.core.speculative import Speculation


@dataclass(frozen=True)
class SimSettings:
    """The [engine] keys that shape a schedule, defaulting to EngineConfig's (num_blocks 0: here, enough
    for every request at once)."""

    prefill_chunk: int = EngineConfig.prefill_chunk
    max_batch_tokens: int = EngineConfig.max_batch_tokens
    max_num_seqs: int = EngineConfig.max_num_seqs
    block_size: int = EngineConfig.block_size
    num_blocks: int = EngineConfig.num_blocks
    tpot_target_ms: float = EngineConfig.tpot_target_ms
    waiting_share: float = EngineConfig.waiting_share
    slo_ttft_ms: float = EngineConfig.slo_ttft_ms
    slo_tpot_ms: float = EngineConfig.slo_tpot_ms
    max_partial_prefills: int = EngineConfig.max_partial_prefills
    long_prefill_threshold: int = EngineConfig.long_prefill_threshold
    max_long_partial_prefills: int = EngineConfig.max_long_partial_prefills
    speculative: str = EngineConfig.speculative
    num_speculative_tokens: int = EngineConfig.num_speculative_tokens

    @classmethod
    def from_engine_config(cls, cfg: object) -> SimSettings:
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


@dataclass
class SimRun:
    """What a simulated run produced: the bench's per-request results, its duration, and every step."""

    results: list[RequestResult]
    duration_s: float
    steps: list[StepRecord]


def build_scheduler(s: SimSettings, cost: CostCoefficients, specs: Sequence[RequestSpec],
                    clock: Callable[[], float] = lambda: 0.0) -> Scheduler:
    """The scheduler as the engine builds it from the same settings; `clock`: the replay's time (the
    SLO mode reads it)."""
    num_blocks = s.num_blocks or sum(-(-(x.prompt_len + x.output_len) // s.block_size) for x in specs) + 1
    cfg = SchedulerConfig(s.max_batch_tokens, s.max_num_seqs, s.block_size, num_blocks,
                          max_partial_prefills=s.max_partial_prefills,
                          long_prefill_threshold=s.long_prefill_threshold,
                          max_long_partial_prefills=s.max_long_partial_prefills)
    sched = Scheduler(cfg, BlockPool(num_blocks))
    if s.speculative:  # the replay's tokens are all alike, so every decode finds a draft
        sched.with_speculation(Speculation(s.num_speculative_tokens,
                                           "ngram" if s.speculative == "ngram" else "draft"))
    budget = step_budget_for(StepCostModel(cost), s.tpot_target_ms, s.slo_ttft_ms, s.slo_tpot_ms, clock)
    if budget is not None:  # as LLMEngine: the target (or the SLO mode) sizes every chunk
        sched.with_prefill_policy(Chunked(s.max_batch_tokens))
        sched.with_step_budget(budget, s.waiting_share)
    else:
        sched.with_prefill_policy(Chunked(s.prefill_chunk) if s.prefill_chunk > 0 else WholePrompt())
    return sched


def simulate(specs: Sequence[RequestSpec], cost: CostCoefficients, s: SimSettings,
             noise: StepNoise | None = None, seed: int = 0, acceptance: float = 0.7) -> SimRun:
    """Run every request to its last token; each step lasts what `cost` predicts for it (times a ratio
    drawn from `noise` with `seed`, when given: the budget still plans by `cost`, and its margin learns).
    With speculation, each draft token is kept with probability `acceptance` once the ones before it were
    (seeded): the per-token rate a live run's metrics give (accepted / drafts tested)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be within 0..1, got {acceptance!r}")
    replay = noise.replay(seed) if noise is not None else None
    draws = random.Random(seed)
    for x in specs:
        if x.prompt_len < 1 or x.output_len < 1:
            raise ValueError(f"request {x.index}: prompt_len and output_len must be >= 1 (a text prompt "
                             "has no known length: simulate needs token counts)")
    clock = 0.0
    sched = build_scheduler(s, cost, specs, lambda: clock)
    pending = sorted(specs, key=lambda x: (x.arrival_s, x.index))
    results = {x.index: RequestResult(x.index, x.kind, x.prompt_len, x.output_len, ok=True, start=x.arrival_s,
                                      prompt_tokens=x.prompt_len, completion_tokens=x.output_len)
               for x in specs}
    steps: list[StepRecord] = []
    i = 0
    while i < len(pending) or sched.has_unfinished():
        while i < len(pending) and pending[i].arrival_s <= clock:  # joins between steps, as in the engine
            x = pending[i]
            sched.add_request(str(x.index), [1] * x.prompt_len, x.output_len)
            i += 1
        if not sched.has_unfinished():
            clock = pending[i].arrival_s
            continue
        out = sched.schedule()
        if out.num_tokens == 0:
            raise RuntimeError("the scheduler scheduled nothing while requests are unfinished")
        p = plan(sched, out)
        duration = cost.predict(step_features((q.start, len(q.tokens)) for q in p.batch.seqs))
        if replay is not None:
            planned = 0 < len(out.decodes) < out.num_tokens
            ratio = replay.next(planned)
            duration *= ratio
            if planned and sched.step_budget is not None:  # the budget's margin learns the spread, as live
                sched.step_budget.model.step_drift.observe_residual(ratio)
        steps.append(StepRecord(clock, duration, len(out.decodes), out.num_tokens - len(out.decodes)))
        clock += duration
        sampled = {rid: [1] * (kept_drafts(out.drafts.get(rid, ()), acceptance, draws) + 1)
                   for _, rid in p.sample}
        for rid, tokens in sampled.items():
            results[int(rid)].token_times.extend([clock] * len(tokens))
        if sched.speculation is not None and out.decodes:  # as the engine's step loop
            useful = len(out.decodes) + sum(len(t) - 1 for t in sampled.values()) + \
                sum(c.length for c in out.chunks)
            sched.speculation.gate.observe(len(out.decodes), bool(out.drafts), useful, duration,
                                           bool(out.chunks))
        for rid in sched.update(out, sampled):
            results[int(rid)].end = clock
            sched.abort(rid)  # forget it: a long replay keeps only what it reports
    return SimRun([results[k] for k in sorted(results)], clock, steps)


def kept_drafts(draft: Sequence[int], acceptance: float, draws: random.Random) -> int:
    """How many of `draft` a replayed verification keeps: each with `acceptance`, until one is not."""
    n = 0
    while n < len(draft) and draws.random() < acceptance:
        n += 1
    return n


def load_requests(path: str | Path) -> list[RequestSpec]:
    """A JSONL of {"arrival_s", "prompt_len", "output_len", "kind"?} lines; ValueError names the line."""
    specs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, prompt_len = float(row["arrival_s"]), int(row["prompt_len"])
            output_len = int(row["output_len"])
            kind = str(row.get("kind", "short"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: line {n}: needs arrival_s, prompt_len and output_len ({e})") from None
        if arrival < 0 or prompt_len < 1 or output_len < 1:
            raise ValueError(f"{path}: line {n}: arrival_s must be >= 0, prompt_len and output_len >= 1")
        specs.append(RequestSpec(len(specs), arrival, [], prompt_len, output_len, kind))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs
