"""The Prometheus cross-check and the step_trace reader."""

from __future__ import annotations

import json

import pytest

from mixserve.bench.promcheck import ITL_METRIC, TTFT_METRIC, HistogramTotals, compare, parse_histograms
from mixserve.bench.trace import read_step_trace

EXPOSITION = """# HELP mixserve:time_to_first_token_seconds TTFT
# TYPE mixserve:time_to_first_token_seconds histogram
mixserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
mixserve:time_to_first_token_seconds_sum{model_name="m"} 1.5
mixserve:time_to_first_token_seconds_count{model_name="m"} 4.0
mixserve:time_to_first_token_seconds_sum{model_name="other"} 0.5
mixserve:time_to_first_token_seconds_count{model_name="other"} 1.0
mixserve:time_per_output_token_seconds_sum{model_name="m"} 2.0
mixserve:time_per_output_token_seconds_count{model_name="m"} 40.0
mixserve:time_per_output_token_seconds_created{model_name="m"} 1.7e9
mixserve:e2e_request_latency_seconds_sum{model_name="m"} 99.0
"""


def test_histogram_totals_sum_over_label_sets_and_ignore_other_series():
    h = parse_histograms(EXPOSITION)
    assert h[TTFT_METRIC] == HistogramTotals(2.0, 5.0)
    assert h[ITL_METRIC] == HistogramTotals(2.0, 40.0)
    assert parse_histograms("")[TTFT_METRIC] == HistogramTotals(0.0, 0.0)


def test_compare_uses_the_increase_over_the_run():
    before = {TTFT_METRIC: HistogramTotals(10.0, 10.0), ITL_METRIC: HistogramTotals(1.0, 100.0)}
    after = {TTFT_METRIC: HistogramTotals(12.0, 14.0), ITL_METRIC: HistogramTotals(3.0, 200.0)}
    c = compare(before, after, bench_ttft_mean=0.525, bench_itl_mean=0.03)
    assert c["server_ttft_mean_s"] == pytest.approx(0.5) and c["server_ttft_count"] == 4
    assert c["server_itl_mean_s"] == pytest.approx(0.02)
    assert c["ttft_ratio"] == pytest.approx(1.05) and c["itl_ratio"] == pytest.approx(1.5)
    assert c["agree_within_10pct"] is False
    assert compare(before, after, 0.5, 0.021)["agree_within_10pct"] is True
    assert compare(None, after, 0.5, 0.02) is None


def test_step_trace_reads_steps_relative_to_the_first(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"step": 0, "time": 100.5, "decode_tokens": 0, "prefill_tokens": 40, "duration_s": 0.5},
        {"step": 1, "time": 100.7, "decode_tokens": 3, "prefill_tokens": 0, "duration_s": 0.2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + '{"step": 2, "ti')  # cut-off last line
    steps = read_step_trace(path)
    assert len(steps) == 2
    assert steps[0].start_s == pytest.approx(0.0) and steps[1].start_s == pytest.approx(0.2)
    assert (steps[0].decode_tokens, steps[0].prefill_tokens) == (0, 40)
    assert steps[1].duration_s == pytest.approx(0.2)
    assert read_step_trace(tmp_path / "missing.jsonl") == []
    # lined up with the bench start on the clock nearest the trace's (here the first: monotonic-like)
    aligned = read_step_trace(path, clocks=(99.0, 1.7e9))
    assert aligned[0].start_s == pytest.approx(1.5) and aligned[1].start_s == pytest.approx(1.7)
