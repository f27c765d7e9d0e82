"""The report maths: per-request timings, percentiles, goodput, per-class stalls; plain data in and out."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

STALL_THRESHOLD_S = 0.5  # PERF.md counts short requests that paused longer than this between two tokens


@dataclass
class RequestResult:
    """What the client saw of one request; times are seconds since the bench started."""

    index: int
    kind: str
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per streamed token chunk
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """Output tokens: the server's usage when it sent one, else the chunks counted."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (n - 1); None for a single token."""
        n = self.num_tokens
        if n < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def gaps(self) -> list[float]:
        """Every inter-token gap the client saw."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def max_gap(self) -> float | None:
        return max(self.gaps, default=None)

    @property
    def e2e(self) -> float:
        return self.end - self.start


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99 and max of the values that are not None (all None when there are none)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50), "p90": percentile(v, 90),
            "p99": percentile(v, 99), "max": max(v)}


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """A completed request within both SLOs (a missing SLO holds; a single-token request has no TPOT)."""
    if not r.ok:
        return False
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


def class_stats(results: Sequence[RequestResult], stall_threshold: float = STALL_THRESHOLD_S) -> dict:
    """TTFT, TPOT, the worst inter-token gap and the stalled count of one class of completed requests."""
    done = [r for r in results if r.ok]
    gaps = [r.max_gap for r in done if r.max_gap is not None]
    return {
        "count": len(done),
        "ttft_s": summarize(r.ttft for r in done),
        "tpot_s": summarize(r.tpot for r in done),
        "max_gap_s": max(gaps, default=None),
        "stalled": sum(1 for g in gaps if g > stall_threshold),
    }


def build_report(
    results: Sequence[RequestResult],
    duration: float,
    *,
    settings: dict | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    stall_threshold: float = STALL_THRESHOLD_S,
) -> dict:
    """The JSON report of one run: throughput, latency summaries, goodput, failures and per-class figures."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.num_tokens for r in done)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    kinds = sorted({r.kind for r in results})
    return {
        "settings": dict(settings or {}, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                         stall_threshold_s=stall_threshold),
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        "failures": [{"index": r.index, "kind": r.kind, "reason": r.error} for r in failed],
        "failure_reasons": dict(Counter(r.error.split(":")[0] for r in failed)),
        "duration_s": duration,
        "request_throughput": per_second(len(done)),
        "output_token_throughput": per_second(out_tokens),
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "total_output_tokens": out_tokens,
        "usage_missing": sum(1 for r in done if r.completion_tokens is None),
        "ttft_s": summarize(r.ttft for r in done),
        "tpot_s": summarize(r.tpot for r in done),
        "itl_s": summarize(g for r in done for g in r.gaps),
        "e2e_s": summarize(r.e2e for r in done),
        "goodput": per_second(sum(1 for r in done if meets_slo(r, slo_ttft, slo_tpot))),
        # the share of all requests that met both SLOs (a failed one never does); None without an SLO
        "slo_attainment": sum(1 for r in done if meets_slo(r, slo_ttft, slo_tpot)) / len(results)
        if results and (slo_ttft is not None or slo_tpot is not None) else None,
        "classes": {k: class_stats([r for r in results if r.kind == k], stall_threshold) for k in kinds},
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def format_summary(report: dict) -> str:
    """The human summary table a run prints."""
    rows = [
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("request throughput (req/s)", _num(report["request_throughput"])),
        ("output token throughput (tok/s)", _num(report["output_token_throughput"])),
        ("goodput (req/s)", _num(report["goodput"])),
    ]
    if report.get("slo_attainment") is not None:
        rows.append(("SLO attainment", f"{report['slo_attainment']:.1%}"))
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        s = report[key]
        rows.append((f"{name} mean/p50/p90/p99 (ms)",
                     "/".join(_ms(s[p]) for p in ("mean", "p50", "p90", "p99"))))
    for kind, c in report["classes"].items():
        rows.append((f"[{kind}] TTFT p50/p99 (ms)", f"{_ms(c['ttft_s']['p50'])}/{_ms(c['ttft_s']['p99'])}"))
        rows.append((f"[{kind}] TPOT p50/p99 (ms)", f"{_ms(c['tpot_s']['p50'])}/{_ms(c['tpot_s']['p99'])}"))
        stalls = f"{_ms(c['max_gap_s'])}, {c['stalled']} of {c['count']}"
        rows.append((f"[{kind}] max gap (ms), stalled", stalls))
    check = report.get("server_check")
    if check:
        rows.append(("bench/server TTFT mean", _num(check.get("ttft_ratio"))))
        rows.append(("bench/server ITL mean", _num(check.get("itl_ratio"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
