"""Scheduler and engine statistics: plain snapshots the metrics layer and the engine's log line read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """Requests running and waiting, KV cache use, preemptions so far, and the last step's tokens."""

    num_requests_running: int
    num_requests_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int  # since the scheduler was built (a counter)
    step_decode_tokens: int  # in the last scheduled step (a decode's drafts count here too)
    step_prefill_tokens: int
    # Prefix caching, since the scheduler was built (counters, in tokens; 0 with caching off): tokens of
    # the requests admitted, and how many of them were found in the cache instead of computed.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0  # blocks holding a cached prefix, referenced or not (a gauge)
    # Speculative decoding, since the scheduler was built (counters; core/speculative.py SpecCounts).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # The step cost model while a TPOT target is on (None otherwise): the last step's predicted and
    # measured time, and the coefficients of core/cost_model.py (overhead_s, per_token_s, per_pair_s,
    # per_seq_s), and what the budget scales the fit by: the drift and the spread's margin (step_drift.py).
    step_predicted_s: float | None = None
    step_actual_s: float | None = None
    cost_coefficients: tuple[float, ...] | None = None
    cost_drift: float | None = None
    cost_margin: float | None = None
    # Serving to an SLO (core/slo.py; 0 / None when off): requests given up on per SLO and exclusive steps
    # so far (counters), and the last step's time limit and mode (mixed | decode-only | prefill-only).
    slo_given_up_ttft: int = 0
    slo_given_up_tpot: int = 0
    slo_exclusive_steps: int = 0
    slo_stretched_steps: int = 0
    slo_step_limit_s: float | None = None
    slo_mode: str | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests, 0.0 .. 1.0 (cached blocks nobody holds count as free)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    @property
    def step_tokens(self) -> int:
        return self.step_decode_tokens + self.step_prefill_tokens


@dataclass(frozen=True)
class EngineStats:
    """Scheduler state plus the engine's counters (totals since start): the one source of /metrics'
    token counters (metrics/prometheus.py turns totals into Prometheus counter increments)."""

    scheduler: SchedulerStats
    num_steps: int
    num_prompt_tokens_total: int  # prompt tokens of requests that got their first token (once per request)
    num_generation_tokens_total: int  # tokens sampled, every choice of every request
    num_preemptions_total: int

    @property
    def num_requests_running(self) -> int:
        return self.scheduler.num_requests_running

    @property
    def num_requests_waiting(self) -> int:
        return self.scheduler.num_requests_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage

    @property
    def step_tokens(self) -> int:
        return self.scheduler.step_tokens
