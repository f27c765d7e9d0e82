"""The report maths on synthetic timestamps: percentiles, TPOT, goodput, failures, per-class stalls."""

from __future__ import annotations

import pytest

from mixserve.bench.report import (
    RequestResult,
    build_report,
    format_summary,
    meets_slo,
    percentile,
    summarize,
)


def done(index: int, start: float, times: list[float], kind: str = "short", usage: int | None = None):
    """A completed request that started at `start` and streamed tokens at `times`."""
    n = len(times) if usage is None else usage
    return RequestResult(index, kind, 16, n, ok=True, start=start, end=times[-1], token_times=list(times),
                         prompt_tokens=16, completion_tokens=n)


def test_percentile_interpolates_linearly_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1, 2, 3, 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # pos 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_an_error_and_summarize_skips_none():
    with pytest.raises(ValueError):
        percentile([], 50)
    s = summarize([None, 1.0, 3.0])
    assert s["count"] == 2 and s["mean"] == 2.0 and s["max"] == 3.0
    assert summarize([None])["p50"] is None


def test_ttft_tpot_and_gaps_of_one_request():
    r = done(0, 1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((2.1 - 1.5) / 3)
    assert r.gaps == pytest.approx([0.1, 0.2, 0.3])
    assert r.max_gap == pytest.approx(0.3)
    assert r.e2e == pytest.approx(1.1)


def test_tpot_divides_by_the_servers_token_count_not_the_chunks():
    # 3 chunks seen, but usage says 5 tokens (the server merged some into one chunk)
    r = done(0, 0.0, [1.0, 1.2, 1.4], usage=5)
    assert r.num_tokens == 5
    assert r.tpot == pytest.approx(0.4 / 4)


def test_a_single_token_request_has_no_tpot_and_still_meets_a_tpot_slo():
    r = done(0, 0.0, [0.2])
    assert r.tpot is None
    assert meets_slo(r, slo_ttft=0.5, slo_tpot=0.01)
    assert not meets_slo(r, slo_ttft=0.1, slo_tpot=None)


def test_goodput_counts_requests_meeting_both_slos_per_second():
    results = [
        done(0, 0.0, [0.1, 0.2, 0.3]),  # ttft 0.1, tpot 0.1: meets both
        done(1, 0.0, [0.9, 1.0, 1.1]),  # ttft 0.9: misses TTFT
        done(2, 0.0, [0.1, 0.6, 1.1]),  # tpot 0.5: misses TPOT
        done(3, 0.0, [0.2, 0.3]),  # meets both
    ]
    rep = build_report(results, duration=2.0, slo_ttft=0.5, slo_tpot=0.2)
    assert rep["goodput"] == pytest.approx(2 / 2.0)
    assert rep["request_throughput"] == pytest.approx(4 / 2.0)
    assert rep["output_token_throughput"] == pytest.approx(11 / 2.0)
    # no SLO given: every completed request counts
    assert build_report(results, duration=2.0)["goodput"] == pytest.approx(2.0)


def test_failed_requests_are_listed_with_reasons_and_left_out_of_latencies():
    ok = done(0, 0.0, [0.1, 0.2])
    bad = RequestResult(1, "long", 1500, 8, ok=False, error="HTTP 400: prompt too long", start=0.0, end=0.05)
    lost = RequestResult(2, "short", 16, 8, ok=False, error="ReadTimeout: timed out")
    rep = build_report([ok, bad, lost], duration=1.0, slo_ttft=1.0)
    assert rep["completed"] == 1 and rep["failed"] == 2
    assert rep["failures"][0] == {"index": 1, "kind": "long", "reason": "HTTP 400: prompt too long"}
    assert rep["failure_reasons"] == {"HTTP 400": 1, "ReadTimeout": 1}
    assert rep["ttft_s"]["count"] == 1 and rep["ttft_s"]["mean"] == pytest.approx(0.1)
    assert rep["goodput"] == pytest.approx(1.0)
    assert rep["classes"]["long"]["count"] == 0 and rep["classes"]["long"]["max_gap_s"] is None


def test_itl_summary_covers_every_gap_of_every_request():
    rep = build_report([done(0, 0.0, [0.1, 0.2, 0.5]), done(1, 0.0, [0.3, 0.4])], duration=1.0)
    assert rep["itl_s"]["count"] == 3
    assert rep["itl_s"]["mean"] == pytest.approx((0.1 + 0.3 + 0.1) / 3)


def test_per_class_stalls_count_short_requests_that_paused_past_the_threshold():
    results = [
        done(0, 0.0, [0.1, 0.2, 0.3]),  # worst gap 0.1
        done(1, 0.0, [0.1, 0.7, 0.8]),  # worst gap 0.6: stalled
        done(2, 0.0, [0.1, 0.2, 1.4]),  # worst gap 1.2: stalled
        done(3, 0.0, [0.1, 0.6]),  # worst gap exactly 0.5: not over it
        done(4, 0.5, [2.0, 3.5], kind="long"),  # long prompts are their own class
    ]
    rep = build_report(results, duration=4.0)
    short, long_ = rep["classes"]["short"], rep["classes"]["long"]
    assert short["count"] == 4 and short["stalled"] == 2
    assert short["max_gap_s"] == pytest.approx(1.2)
    assert long_["count"] == 1 and long_["stalled"] == 1
    assert long_["ttft_s"]["p50"] == pytest.approx(1.5)
    # a stricter threshold counts more
    assert build_report(results, duration=4.0, stall_threshold=0.3)["classes"]["short"]["stalled"] == 3


def test_summary_table_names_the_figures():
    rep = build_report([done(0, 0.0, [0.1, 0.2])], duration=1.0)
    text = format_summary(rep)
    assert "TTFT mean/p50/p90/p99 (ms)" in text and "100.0" in text
    assert "[short] max gap (ms), stalled" in text
