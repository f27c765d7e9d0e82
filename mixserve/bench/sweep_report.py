"""The sweep's comparison: one table row per run, the median row of a setting's repeated runs, the
recommendation, and the markdown report (sweep.md)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sweep imports this module: only the type, not a cycle at run time
    from mixserve.bench.sweep import Setting

# Fields that name a setting rather than measure a run: copied, never aggregated.
IDENTITY = ("setting", "policy", "prefill_chunk", "max_batch_tokens", "tpot_target_ms", "slo_mode")
# What the per-run table shows of every run, so a reader sees the spread behind each median.
RUN_FIGURES = ("short_stalled", "short_max_gap_s", "long_ttft_p50_s")


def table_row(s: Setting, report: dict) -> dict:
    """The figures PERF.md's workload M table reports, plus throughput, the longest step and the check;
    "round" is the run's place among interleaved repeats (1 without repeats)."""
    row = {"setting": s.label, "policy": s.policy, "prefill_chunk": s.prefill_chunk,
           "max_batch_tokens": s.max_batch_tokens, "tpot_target_ms": s.tpot_target_ms,
           "slo_mode": s.slo_mode, "round": report.get("settings", {}).get("round", 1)}
    if "error" in report:
        return dict(row, error=report["error"].splitlines()[0])
    short = report["classes"].get("short", {})
    long_ = report["classes"].get("long", {})
    short_tpot, short_ttft = short.get("tpot_s", {}), short.get("ttft_s", {})
    long_ttft = long_.get("ttft_s", {})
    check = report.get("server_check") or {}
    return dict(
        row,
        completed=report["completed"], failed=report["failed"],
        short_tpot_p50_s=short_tpot.get("p50"), short_tpot_p99_s=short_tpot.get("p99"),
        short_max_gap_s=short.get("max_gap_s"), short_stalled=short.get("stalled"),
        short_count=short.get("count"),
        short_ttft_p50_s=short_ttft.get("p50"), short_ttft_p99_s=short_ttft.get("p99"),
        long_ttft_p50_s=long_ttft.get("p50"), long_ttft_max_s=long_ttft.get("max"),
        output_token_throughput=report["output_token_throughput"], duration_s=report["duration_s"],
        goodput=report.get("goodput"), slo_attainment=report.get("slo_attainment"),
        max_step_s=report.get("steps", {}).get("max_step_s"),
        max_step_tokens=report.get("steps", {}).get("max_step_tokens"),
        ttft_ratio=check.get("ttft_ratio"), itl_ratio=check.get("itl_ratio"),
        agree_within_10pct=check.get("agree_within_10pct"),
    )


def median_row(runs: Sequence[dict]) -> dict:
    """One setting's row: each figure the median over its runs that did not fail to run (a flag: all of
    them), with every run's row kept under "runs". Only if every run failed is the row itself an error."""
    if not runs:
        raise ValueError("a setting's row needs at least one run")
    ok = [r for r in runs if "error" not in r]
    first = ok[0] if ok else runs[0]
    row: dict = {k: first[k] for k in IDENTITY}
    if not ok:
        row["error"] = runs[0]["error"]
    for key in first:
        if key in IDENTITY or key in ("round", "error"):
            continue
        values = [r[key] for r in ok if r.get(key) is not None]
        if not values:
            row[key] = None
        elif all(isinstance(v, bool) for v in values):
            row[key] = all(values)
        else:
            row[key] = statistics.median(values)
    row["repeats"] = len(runs)
    row["failed_runs"] = len(runs) - len(ok)
    row["runs"] = list(runs)
    return row


def recommend(rows: Sequence[dict]) -> str | None:
    """The setting with the fastest long prompts (median) among those where no run failed to run and the
    median run failed no request and stalled none."""
    ok = [r for r in rows if "error" not in r and not r.get("failed_runs") and not r["failed"]
          and r["short_stalled"] == 0 and r["long_ttft_p50_s"] is not None]
    if not ok:
        return None
    best = min(ok, key=lambda r: (r["long_ttft_p50_s"], r["short_tpot_p99_s"] or 0.0))
    return best["setting"]


def _f(x, scale: float = 1.0, fmt: str = ".0f") -> str:
    return "–" if x is None else format(x * scale, fmt)


def _count(x) -> str:
    """A count, or the median of counts (x.5 between two runs)."""
    return "–" if x is None else format(x, "g")


def per_run_lines(rows: Sequence[dict]) -> list[str]:
    """A table of every run's key figures, in round order, beside its setting's median."""
    lines = ["| setting | stalled, per run | max gap (ms), per run | long TTFT p50 (s), per run |",
             "|---|---|---|---|"]
    for r in rows:
        runs = sorted(r.get("runs") or [], key=lambda x: x["round"])
        cells = []
        for key, scale, fmt in (("short_stalled", 1, "g"), ("short_max_gap_s", 1000, ".0f"),
                                ("long_ttft_p50_s", 1, ".2f")):
            cells.append(", ".join("failed" if "error" in x else _f(x.get(key), scale, fmt) for x in runs))
        lines.append(f"| {r['setting']} | {' | '.join(cells)} |")
    return lines


def markdown(summary: dict) -> str:
    """The comparison table as markdown, with the machine and workload it ran on."""
    m, w = summary["machine"], summary["workload"]
    repeats = summary.get("repeats", 1)
    lines = [
        "# prefill_chunk sweep",
        "",
        f"Command: `{summary.get('command') or 'mixserve bench sweep'}`.",
        f"Machine: {m['nproc']} cores ({m['cpu_model']}), {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}; load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}.",
        f"Workload: {json.dumps(w)}.",
        "",
    ]
    if repeats > 1:
        lines += [f"Every setting ran {repeats} times, interleaved (round 1 ran each setting once, "
                  "then round 2, ...), so a machine whose speed drifts over minutes weighs on every setting "
                  "alike; each figure below is the median over a setting's runs (every run's own figures "
                  "follow).", ""]
    lines += [
        "| setting | short TPOT p50/p99 (ms) | max gap (ms) | stalled | short TTFT p50/p99 (ms) "
        "| long TTFT p50 / max (s) | output tok/s | longest step (ms, tokens) | failed "
        "| bench/server TTFT, ITL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        if "error" in r:
            lines.append(f"| {r['setting']} | failed: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['setting']} | {_f(r['short_tpot_p50_s'], 1000)}/{_f(r['short_tpot_p99_s'], 1000)} "
            f"| {_f(r['short_max_gap_s'], 1000)} "
            f"| {_count(r['short_stalled'])} of {_count(r['short_count'])} "
            f"| {_f(r['short_ttft_p50_s'], 1000)}/{_f(r['short_ttft_p99_s'], 1000)} "
            f"| {_f(r['long_ttft_p50_s'], 1, '.2f')} / {_f(r['long_ttft_max_s'], 1, '.2f')} "
            f"| {_f(r['output_token_throughput'], 1, '.1f')} "
            f"| {_f(r['max_step_s'], 1000)}, {_f(r['max_step_tokens'])} "
            f"| {_count(r['failed'])} | {_f(r['ttft_ratio'], 1, '.3f')}, {_f(r['itl_ratio'], 1, '.3f')} |"
        )
    if repeats > 1:
        lines += ["", "Every run (in round order):", "", *per_run_lines(summary["rows"])]
    lines += [
        "",
        "Stalled: short requests with a gap over the stall threshold "
        f"({summary['options']['stall_threshold']} s) between two tokens, of those completed. "
        "Bench/server: the bench's TTFT and inter-token-latency means over the server's own histogram "
        "means (mixserve:time_to_first_token_seconds, mixserve:time_per_output_token_seconds), "
        "scraped before and after the run; 1.000 is perfect agreement.",
        "WholePrompt at a big budget prefills a long prompt in one step beside the decodes (the stall); "
        "WholePrompt over its budget waits for a step of its own; Chunked(k) prefills at most k tokens a "
        "step after the decodes.",
        "",
        "Without a failed or stalled request, the fastest long prompts (TTFT p50"
        f"{', medians' if repeats > 1 else ''}): **{summary.get('recommended') or 'no setting'}**.",
        "",
        "frontier.png: each setting as a point of (the short requests' worst gap, the long prompts' TTFT "
        "p50); a TPOT target's point should sit left of the stall line and as low as the big budgets'."
        + (" Big points are the medians, small ones each run." if repeats > 1 else ""),
        "",
    ]
    return "\n".join(lines)
