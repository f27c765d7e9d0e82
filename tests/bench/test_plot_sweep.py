"""Pictures from synthetic reports, sweep settings, the comparison table, and the CLI's workloads."""

from __future__ import annotations

import argparse
import json

import pytest

from mixserve.bench import sweep
from mixserve.bench.plot import (
    Timeline,
    cdf_points,
    plot_frontier,
    plot_run,
    plot_sweep_tpot,
    plot_sweep_ttft,
    plot_timelines,
)
from mixserve.bench.report import RequestResult, build_report
from mixserve.bench.run import RunOptions, request_records, results_from_records
from mixserve.bench.sweep import Setting, SettingRun, markdown, parse_settings, recommend, table_row
from mixserve.bench.sweep_report import median_row
from mixserve.bench.trace import StepRecord
from mixserve.cli import bench as bench_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_report(stall: float, with_failure: bool = True, long_ttft: float = 1.7) -> dict:
    """Six short requests whose worst gap is max(stall, 0.2) s, a long one of TTFT `long_ttft`."""
    results = [RequestResult(i, "short", 40, 4, ok=True, start=0.1 * i, end=0.1 * i + 1.0,
                             token_times=[0.1 * i + t for t in (0.2, 0.3, 0.3 + stall, 0.5 + stall)],
                             prompt_tokens=40, completion_tokens=4) for i in range(6)]
    first = 0.2 + long_ttft
    results.append(RequestResult(6, "long", 900, 2, ok=True, start=0.2, end=first + 0.1,
                                 token_times=[first, first + 0.1], prompt_tokens=900, completion_tokens=2))
    if with_failure:
        results.append(RequestResult(7, "short", 40, 4, ok=False, error="HTTP 503: busy", start=0.3,
                                     end=0.31))
    report = build_report(results, duration=2.5, settings={"model": "tiny"})
    report["requests"] = request_records(results)
    report["server_check"] = {"ttft_ratio": 1.02, "itl_ratio": 0.97, "agree_within_10pct": True}
    report["steps"] = {"max_step_s": 0.6, "max_step_tokens": 903}
    return report


def test_cdf_points_rise_to_one():
    assert cdf_points([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0])


def test_request_records_round_trip_the_timings():
    report = synthetic_report(0.1)
    back = results_from_records(report["requests"])
    assert back[6].ttft == pytest.approx(1.7) and back[0].tpot == pytest.approx((0.5 + 0.1 - 0.2) / 3)
    assert not back[7].ok


def test_pictures_are_written_as_png(tmp_path):
    runs = [("WholePrompt, budget 2048", synthetic_report(0.9)),
            ("chunk 64, budget 512", synthetic_report(0.1))]
    steps = [StepRecord(0.0, 0.05, 0, 40), StepRecord(0.05, 0.6, 3, 900), StepRecord(0.65, 0.04, 4, 0)]
    paths = [
        plot_run(runs[0][1], tmp_path / "run.png"),
        plot_sweep_ttft(runs, tmp_path / "ttft.png"),
        plot_sweep_tpot(runs, tmp_path / "tpot.png"),
        plot_timelines([Timeline(label, steps, 512, [0.2]) for label, _ in runs], tmp_path / "t.png"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000


def test_settings_cap_the_chunk_at_the_budget_and_add_the_big_whole_prompt_case():
    settings = parse_settings("0,16,64,1024,32:128", 512, whole_prompt_budget=2048)
    assert settings == [Setting(0, 2048), Setting(0, 512), Setting(16, 512), Setting(64, 512),
                        Setting(512, 512), Setting(32, 128)]
    assert [s.slug for s in settings[:3]] == ["whole-b2048", "whole-b512", "chunk16-b512"]
    assert settings[2].policy == "Chunked(16)" and settings[0].policy == "WholePrompt"
    assert parse_settings("0,0", 512) == [Setting(0, 512)]
    with pytest.raises(ValueError):
        parse_settings("-1", 512)


def test_comparison_table_carries_the_perf_md_columns():
    rows = [table_row(Setting(0, 2048), synthetic_report(0.9)),
            table_row(Setting(64, 512), synthetic_report(0.1, with_failure=False)),
            table_row(Setting(16, 512), {"settings": {}, "error": "server exited with 1\nTraceback"})]
    assert rows[0]["short_stalled"] == 6 and rows[1]["short_stalled"] == 0
    assert rows[0]["short_max_gap_s"] == pytest.approx(0.9)
    assert rows[0]["long_ttft_p50_s"] == pytest.approx(1.7)
    summary = {"command": "mixserve bench sweep", "recommended": recommend(rows),
               "machine": {"nproc": 2, "cpu_model": "X", "platform": "Linux", "python": "3.11", "torch": "2",
                           "loadavg_at_start": (1.0, 1.0, 1.0)},
               "workload": {"workload": "M"}, "options": {"stall_threshold": 0.5}, "rows": rows}
    md = markdown(summary)
    # TPOT (0.5 + 0.9 - 0.2) / 3 = 400 ms; worst gap 900 ms
    assert "| WholePrompt, budget 2048 | 400/400 | 900 | 6 of 6 | 200/200 | 1.70 / 1.70 |" in md
    assert "| chunk 16, budget 512 | failed: server exited with 1 |" in md
    assert "1.020, 0.970" in md and "2 cores (X)" in md
    assert summary["recommended"] == "chunk 64, budget 512" and "**chunk 64, budget 512**" in md


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_sweep_defaults_to_workload_m_and_bench_to_random():
    args = parse(["bench", "sweep", "--seed", "4"])
    assert args.func is bench_cli.sweep_command and args.prefill_chunk == "0,16,64,256"
    specs, desc = bench_cli.build_workload(args)
    assert desc["workload"] == "M" and len(specs) == 52 and desc["seed"] == 4
    args = parse(["bench", "--url", "http://h", "--out", "r.json", "--num-requests", "5",
                  "--request-rate", "inf", "--input-len", "10", "--output-len", "3"])
    specs, desc = bench_cli.build_workload(args)
    assert args.func is bench_cli.bench_command
    assert [(s.prompt_len, s.output_len, s.arrival_s) for s in specs] == [(10, 3, 0.0)] * 5


def test_cli_workload_m_takes_smaller_overrides():
    args = parse(["bench", "sweep", "--num-requests", "6", "--long-input-len", "200", "--request-rate", "5"])
    specs, _ = bench_cli.build_workload(args)
    assert sum(s.kind == "short" for s in specs) == 6
    assert [s.prompt_len for s in specs if s.kind == "long"] == [200] * 4


def test_tpot_targets_are_settings_beside_the_fixed_budgets(tmp_path):
    settings = parse_settings("256:256,256:512", 2048, whole_prompt_budget=2048, targets="0,200,400")
    assert settings == [Setting(0, 2048), Setting(256, 256), Setting(256, 512), Setting(2048, 2048, 200),
                        Setting(2048, 2048, 400)]
    t = settings[-1]
    assert (t.label, t.slug) == ("target 400 ms, budget 2048", "tpot400-b2048")
    assert t.policy == "TpotTarget(400 ms)"
    assert t.server_args("--dtype bfloat16", tmp_path / "c.json") == \
        f"--dtype bfloat16 --tpot-target-ms 400 --cost-model {tmp_path / 'c.json'}"
    assert "--tpot-target-ms" not in settings[0].server_args("", tmp_path / "c.json")
    with pytest.raises(ValueError, match="TPOT target"):
        parse_settings("64", 512, targets="-5")
    args = parse(["bench", "sweep", "--tpot-target-ms", "0,400", "--repeats", "3"])
    assert args.tpot_target_ms == "0,400" and args.repeats == 3
    assert parse(["bench", "sweep"]).repeats == 1


def test_frontier_plot_draws_every_setting(tmp_path):
    rows = [table_row(Setting(0, 2048), synthetic_report(0.9)),
            table_row(Setting(512, 512, 400), synthetic_report(0.1, with_failure=False)),
            table_row(Setting(16, 512), {"settings": {}, "error": "server exited with 1"})]
    assert rows[1]["tpot_target_ms"] == 400
    path = plot_frontier(rows, tmp_path / "frontier.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def fake_sweep(monkeypatch, plan: dict[str, list[tuple[float, float] | None]]) -> list[tuple[str, int, str]]:
    """Replace each server run by a synthetic report: plan[slug][round - 1] is (stall, long TTFT), or None
    for a run whose server failed. Returns the runs as called: (slug, round, file tag)."""
    calls = []
    steps = [StepRecord(0.0, 0.05, 0, 40), StepRecord(0.05, 0.3, 3, 200)]

    def run_setting(s, specs, out, opts, *, tag, info, server_cmd, server_args):
        calls.append((s.slug, info["round"], tag))
        spec = plan[s.slug][info["round"] - 1]
        if spec is None:
            return SettingRun({"settings": info, "error": "server exited with 1"})
        report = synthetic_report(spec[0], with_failure=False, long_ttft=spec[1])
        report["settings"] = dict(report["settings"], **info)
        return SettingRun(report, Timeline(s.label, steps, s.max_batch_tokens, [0.2]))

    monkeypatch.setattr(sweep, "run_setting", run_setting)
    return calls


def test_repeats_interleave_the_settings_round_by_round(monkeypatch, tmp_path):
    settings = [Setting(256, 256), Setting(2048, 2048, 400)]
    plan = {"chunk256-b256": [(0.1, 2.0)] * 3, "tpot400-b2048": [(0.1, 1.5)] * 3}
    calls = fake_sweep(monkeypatch, plan)
    sweep.run_sweep(settings, [], tmp_path, RunOptions(), workload={"workload": "M"}, repeats=3)
    # round 1 runs every setting once, then round 2...: never one setting's repeats back to back
    assert [(slug, k) for slug, k, _ in calls] == [("chunk256-b256", 1), ("tpot400-b2048", 1),
                                                   ("chunk256-b256", 2), ("tpot400-b2048", 2),
                                                   ("chunk256-b256", 3), ("tpot400-b2048", 3)]
    assert [tag for _, _, tag in calls[:2]] == ["chunk256-b256-r1", "tpot400-b2048-r1"]  # own traces
    calls.clear()
    summary = sweep.run_sweep(settings, [], tmp_path, RunOptions(), workload={"workload": "M"})
    assert [tag for _, _, tag in calls] == ["chunk256-b256", "tpot400-b2048"]  # one run: today's names
    assert summary["repeats"] == 1 and "Every run" not in (tmp_path / "sweep.md").read_text()
    with pytest.raises(ValueError, match="repeats"):
        sweep.run_sweep(settings, [], tmp_path, RunOptions(), workload={}, repeats=0)


def test_repeated_settings_report_medians_and_every_run(monkeypatch, tmp_path):
    # the target stalls in its last round only (6 stalled, a 900 ms gap): its median run stalls none;
    # its long TTFTs 2.9, 1.7, 2.1 have median 2.1 (mean 2.23); budget 256's second server failed
    plan = {"tpot400-b2048": [(0.1, 2.9), (0.1, 1.7), (0.9, 2.1)],
            "chunk256-b256": [(0.1, 1.0), None, (0.1, 1.2)],
            "chunk256-b512": [(0.1, 2.5), (0.1, 2.6), (0.1, 2.4)]}
    fake_sweep(monkeypatch, plan)
    settings = [Setting(2048, 2048, 400), Setting(256, 256), Setting(256, 512)]
    summary = sweep.run_sweep(settings, [], tmp_path, RunOptions(), workload={"workload": "M"}, repeats=3)
    target, b256, b512 = summary["rows"]
    assert target["short_stalled"] == 0 and target["short_max_gap_s"] == pytest.approx(0.2)
    assert target["long_ttft_p50_s"] == pytest.approx(2.1)
    assert [r["round"] for r in target["runs"]] == [1, 2, 3]
    assert [r["short_stalled"] for r in target["runs"]] == [0, 0, 6]
    # the failed run is left out of the medians, counted, and keeps its setting from the recommendation
    assert b256["failed_runs"] == 1 and b256["long_ttft_p50_s"] == pytest.approx(1.1)
    assert summary["recommended"] == "target 400 ms, budget 2048"
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["long_ttft_p50_s"] == \
        pytest.approx(2.1)
    md = (tmp_path / "sweep.md").read_text()
    assert "| target 400 ms, budget 2048 | 133/133 | 200 | 0 of 6 | 200/200 | 2.10 / 2.10 |" in md
    assert "| target 400 ms, budget 2048 | 0, 0, 6 | 200, 200, 900 | 2.90, 1.70, 2.10 |" in md
    assert "| chunk 256, budget 256 | 0, failed, 0 |" in md
    assert (tmp_path / "frontier.png").read_bytes()[:8] == PNG_MAGIC


def test_median_row_of_one_run_is_that_run_and_of_failed_runs_an_error():
    one = table_row(Setting(64, 512), synthetic_report(0.9))
    row = median_row([one])
    assert {k: row[k] for k in one if k != "round"} == {k: v for k, v in one.items() if k != "round"}
    assert row["repeats"] == 1 and row["failed_runs"] == 0
    bad = table_row(Setting(64, 512), {"settings": {"round": 2}, "error": "server exited with 1"})
    assert median_row([bad])["error"] == "server exited with 1"
    assert median_row([bad, one])["short_stalled"] == one["short_stalled"]
