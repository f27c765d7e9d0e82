"""The metrics of DESIGN.md section 5, on a registry of their own (never the process-global one).

Every counter is the engine's: the step loop hands over an `EngineStats` (totals since the engine was
built) and each counter goes up by the difference from the last total seen, so /metrics and the engine's
log line count the same tokens. The histograms are fed per request, on the engine's clock (the updates'
token times).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from mixserve.core.cost_model import CostCoefficients
from mixserve.core.stats import EngineStats, SchedulerStats

# Buckets as vLLM's, so dashboards and alerts written for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
COST_RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    """Request latencies, token counters and scheduler gauges of one server; `render()` is /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("mixserve:time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mixserve:time_per_output_token_seconds",
                              "Every gap between two consecutive output tokens of a request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mixserve:e2e_request_latency_seconds", "Arrival to last token of a request.",
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("mixserve:num_requests_running", "Requests holding KV blocks now.", registry=r)
        self.waiting = Gauge("mixserve:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("mixserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                              registry=r)
        self.prompt_tokens = Counter("mixserve:prompt_tokens",
                                     "Prompt tokens of requests that got a first token (once per request).",
                                     registry=r)
        self.generation_tokens = Counter("mixserve:generation_tokens", "Output tokens (every choice).",
                                         registry=r)
        self.preemptions = Counter("mixserve:num_preemptions", "Requests preempted to free KV blocks.",
                                   registry=r)
        self.prefix_queries = Counter("mixserve:prefix_cache_queries",
                                      "Tokens of admitted requests looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("mixserve:prefix_cache_hits",
                                   "Of those, tokens whose KV came from the prefix cache.", registry=r)
        self.step_tokens = Histogram("mixserve:step_tokens", "Tokens (decodes + prefill chunks) per step.",
                                     buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.engine_restarts = Counter("mixserve:engine_restarts", "Failed steps that restarted the engine.",
                                       registry=r)
        # speculative decoding (vLLM's names): decodes that carried drafts, draft tokens, those kept
        self.spec_drafts = Counter("mixserve:spec_decode_num_drafts", "Decodes that carried draft tokens.",
                                   registry=r)
        self.spec_draft_tokens = Counter("mixserve:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         registry=r)
        self.spec_accepted_tokens = Counter("mixserve:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter("mixserve:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft (0: first).",
                                             ["position"], registry=r)
        # serving to an SLO (docs/serving-to-an-slo.md)
        self.slo_given_up = Counter("mixserve:slo_given_up", "Requests that could no longer meet their SLO "
                                    "(still served, no longer protected), by the SLO missed.", ["slo"],
                                    registry=r)
        self.slo_exclusive_steps = Counter("mixserve:slo_exclusive_steps", "Decode-only steps the SLO mode "
                                           "chose over a mixed one (each followed by a prefill-only one).",
                                           registry=r)
        self.slo_stretched_steps = Counter("mixserve:slo_stretched_steps", "Mixed steps the SLO mode gave "
                                           "the time of several paced steps (decode-only ones after them).",
                                           registry=r)
        self.slo_step_limit = Gauge("mixserve:slo_step_limit_seconds", "The SLO mode's time limit of the "
                                    "last step, from the running requests' TPOT slack.", registry=r)
        self._totals_seen: dict[Counter, int] = {}  # the engine's totals at the last observe_stats
        # the step cost model, while a TPOT target is on (docs/latency-target.md)
        self.step_predicted = Gauge("mixserve:step_cost_predicted_seconds",
                                    "The last step's duration as the cost model predicted it.", registry=r)
        self.step_actual = Gauge("mixserve:step_cost_actual_seconds", "The last step's measured duration.",
                                 registry=r)
        self.step_cost_ratio = Histogram("mixserve:step_cost_actual_over_predicted",
                                         "Each step's measured over predicted duration.",
                                         buckets=COST_RATIO_BUCKETS, registry=r)
        self.cost_coefficient = Gauge("mixserve:step_cost_coefficient",
                                      "The cost model's fitted coefficients: step s = overhead_s + "
                                      "per_token_s * tokens + per_pair_s * pairs + per_seq_s * sequences + "
                                      "per_mixed_decode_s * decodes beside a chunk.",
                                      ["term"], registry=r)
        self.cost_drift = Gauge("mixserve:step_cost_drift", "What the budget scales the fit by: the recent "
                                "measured / predicted of planned steps.", registry=r)
        self.cost_margin = Gauge("mixserve:step_cost_margin", "And beyond the drift: the p90 of planned "
                                 "steps' measured / predicted, so a step plans to its p90 time.", registry=r)

    # -- engine side: called by the step loop after each step (or after draining adds/aborts)
    def observe_stats(self, stats: EngineStats | SchedulerStats, *, stepped: bool,
                      extra_waiting: int = 0) -> None:
        """Set the gauges and advance the counters from the engine's snapshot (a bare SchedulerStats has
        no token totals: the token counters stay); `stepped` records its step's tokens."""
        engine = stats if isinstance(stats, EngineStats) else None
        stats = stats.scheduler if isinstance(stats, EngineStats) else stats
        self.running.set(stats.num_requests_running)
        self.waiting.set(stats.num_requests_waiting + extra_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        totals = {self.preemptions: stats.num_preemptions, self.prefix_queries: stats.prefix_cache_queries,
                  self.prefix_hits: stats.prefix_cache_hits, self.spec_drafts: stats.spec_num_drafts,
                  self.spec_draft_tokens: stats.spec_num_draft_tokens,
                  self.spec_accepted_tokens: stats.spec_num_accepted_tokens,
                  self.slo_given_up.labels("ttft"): stats.slo_given_up_ttft,
                  self.slo_given_up.labels("tpot"): stats.slo_given_up_tpot,
                  self.slo_exclusive_steps: stats.slo_exclusive_steps,
                  self.slo_stretched_steps: stats.slo_stretched_steps}
        totals.update({self.spec_accepted_per_pos.labels(str(i)): n
                       for i, n in enumerate(stats.spec_accepted_per_pos)})
        if engine is not None:
            totals[self.prompt_tokens] = engine.num_prompt_tokens_total
            totals[self.generation_tokens] = engine.num_generation_tokens_total
        self._count_totals(totals)
        if stepped and stats.step_tokens > 0:
            self.step_tokens.observe(stats.step_tokens)
        if stepped:
            self._observe_step_cost(stats)
        if stepped and stats.slo_step_limit_s is not None:
            self.slo_step_limit.set(stats.slo_step_limit_s)

    def _observe_step_cost(self, stats: Any) -> None:
        coefficients = getattr(stats, "cost_coefficients", None)
        if coefficients is None:
            return  # no TPOT target
        terms = [f.name for f in fields(CostCoefficients)]  # as CostCoefficients.as_list()
        for term, value in zip(terms, coefficients, strict=True):
            self.cost_coefficient.labels(term).set(value)
        if stats.cost_drift is not None and stats.cost_margin is not None:
            self.cost_drift.set(stats.cost_drift)
            self.cost_margin.set(stats.cost_margin)
        predicted, actual = stats.step_predicted_s, stats.step_actual_s
        if predicted is not None and actual is not None:
            self.step_predicted.set(predicted)
            self.step_actual.set(actual)
            if predicted > 0:
                self.step_cost_ratio.observe(actual / predicted)

    def _count_totals(self, totals: dict[Counter, int]) -> None:
        """Advance each counter to the engine's total. A Counter only goes up, by the difference; a total
        below the last one seen is a new engine (or scheduler), whose whole total is new."""
        for counter, total in totals.items():
            seen = self._totals_seen.get(counter, 0)
            if total < seen:
                seen = 0
            if total > seen:
                counter.inc(total - seen)
            self._totals_seen[counter] = total

    # -- request side: latencies only (the token counts come from the engine's totals)
    def observe_first_token(self, ttft: float) -> None:
        self.ttft.observe(max(ttft, 0.0))

    def observe_token_gap(self, gap: float) -> None:
        self.tpot.observe(max(gap, 0.0))

    def observe_finished(self, e2e: float) -> None:
        self.e2e.observe(max(e2e, 0.0))

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
