"""Cross-check the bench against the server's own Prometheus histograms (_sum/_count before and after)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

TTFT_METRIC = "mixserve:time_to_first_token_seconds"
ITL_METRIC = "mixserve:time_per_output_token_seconds"  # every gap between two tokens (DESIGN.md section 5)
AGREEMENT = 0.10  # the bench and the server agree when their means are within 10%


@dataclass(frozen=True)
class HistogramTotals:
    """_sum and _count of one histogram, summed over its label sets."""

    sum: float = 0.0
    count: float = 0.0


def parse_histograms(
    text: str, names: tuple[str, ...] = (TTFT_METRIC, ITL_METRIC)
) -> dict[str, HistogramTotals]:
    """Totals of each named histogram in a Prometheus text exposition (absent ones are zero)."""
    sums = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric = series.split("{", 1)[0].strip()
        for name in names:
            if metric == f"{name}_sum":
                sums[name] += float(value)
            elif metric == f"{name}_count":
                counts[name] += float(value)
    return {n: HistogramTotals(sums[n], counts[n]) for n in names}


def scrape(root: str, timeout_s: float = 10.0) -> dict[str, HistogramTotals] | None:
    """The histograms at root/metrics; None when the server has no usable /metrics."""
    try:
        resp = httpx.get(f"{root}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_histograms(resp.text)


def _mean_between(before: HistogramTotals, after: HistogramTotals) -> tuple[float | None, int]:
    count = after.count - before.count
    return ((after.sum - before.sum) / count if count > 0 else None), int(count)


def compare(
    before: dict[str, HistogramTotals] | None,
    after: dict[str, HistogramTotals] | None,
    bench_ttft_mean: float | None,
    bench_itl_mean: float | None,
) -> dict | None:
    """Server means over the run next to the bench's, their ratios, and whether both agree within 10%."""
    if before is None or after is None:
        return None
    server_ttft, n_ttft = _mean_between(before[TTFT_METRIC], after[TTFT_METRIC])
    server_itl, n_itl = _mean_between(before[ITL_METRIC], after[ITL_METRIC])
    ttft_ratio = bench_ttft_mean / server_ttft if server_ttft and bench_ttft_mean is not None else None
    itl_ratio = bench_itl_mean / server_itl if server_itl and bench_itl_mean is not None else None
    ratios = (ttft_ratio, itl_ratio)
    return {
        "server_ttft_mean_s": server_ttft, "server_ttft_count": n_ttft, "bench_ttft_mean_s": bench_ttft_mean,
        "server_itl_mean_s": server_itl, "server_itl_count": n_itl, "bench_itl_mean_s": bench_itl_mean,
        "ttft_ratio": ttft_ratio, "itl_ratio": itl_ratio,
        "agree_within_10pct": all(r is not None and abs(r - 1) <= AGREEMENT for r in ratios),
    }
