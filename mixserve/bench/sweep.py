"""`bench sweep`: one server per (prefill_chunk, max_batch_tokens) setting, the same workload against
each, then one comparison table (markdown + JSON) and the pictures."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from mixserve.bench.plot import (
    Timeline,
    plot_frontier,
    plot_run,
    plot_sweep_tpot,
    plot_sweep_ttft,
    plot_timelines,
)
from mixserve.bench.run import RunOptions, run_bench
from mixserve.bench.server import DEFAULT_SERVER_CMD, ServerProcess, free_port, server_command
from mixserve.bench.trace import StepRecord, read_step_trace
from mixserve.bench.workload import RequestSpec


@dataclass(frozen=True)
class Setting:
    """One server configuration of the sweep; prefill_chunk 0 is WholePrompt; a TPOT target (ms) > 0 sizes
    the chunks itself (prefill_chunk is then moot)."""

    prefill_chunk: int
    max_batch_tokens: int
    tpot_target_ms: float = 0

    @property
    def policy(self) -> str:
        if self.tpot_target_ms:
            return f"TpotTarget({self.tpot_target_ms:g} ms)"
        return f"Chunked({self.prefill_chunk})" if self.prefill_chunk else "WholePrompt"

    @property
    def label(self) -> str:
        what = f"chunk {self.prefill_chunk}" if self.prefill_chunk else "WholePrompt"
        if self.tpot_target_ms:
            what = f"target {self.tpot_target_ms:g} ms"
        return f"{what}, budget {self.max_batch_tokens}"

    @property
    def slug(self) -> str:
        what = f"chunk{self.prefill_chunk}" if self.prefill_chunk else "whole"
        if self.tpot_target_ms:
            what = f"tpot{self.tpot_target_ms:g}"
        return f"{what}-b{self.max_batch_tokens}"

    def server_args(self, extra: str, cost_model: Path) -> str:
        """Extra server flags: the target, and where the server writes its cost model on shutdown."""
        target = f" --tpot-target-ms {self.tpot_target_ms:g}" if self.tpot_target_ms else ""
        return f"{extra}{target} --cost-model {shlex.quote(str(cost_model))}"


def parse_settings(spec: str, budget: int, whole_prompt_budget: int = 0, targets: str = "") -> list[Setting]:
    """Settings from "0,16,64,256" (each at `budget`; "CHUNK:BUDGET" sets its own).

    A chunk larger than its budget is capped to it (the budget caps every step anyway). whole_prompt_budget
    > 0 adds WholePrompt at that budget first: the big-budget case where a long prompt shares a step with
    the decodes and stalls them, which chunking exists to fix. `targets` ("0,200,400") adds one setting
    per TPOT target > 0 at `budget` (0 is the fixed settings themselves).
    """
    settings: list[Setting] = []
    if whole_prompt_budget > 0:
        settings.append(Setting(0, whole_prompt_budget))
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        chunk_s, _, budget_s = item.partition(":")
        chunk, b = int(chunk_s), int(budget_s) if budget_s else budget
        if chunk < 0 or b < 1:
            raise ValueError(f"bad setting {item!r}: prefill_chunk must be >= 0 and the budget >= 1")
        s = Setting(min(chunk, b), b)
        if s not in settings:
            settings.append(s)
    for item in (x.strip() for x in targets.split(",")):
        target = float(item) if item else 0.0
        if target < 0:
            raise ValueError(f"bad TPOT target {item!r}: must be >= 0 (0 = the fixed settings)")
        s = Setting(budget, budget, target)
        if target > 0 and s not in settings:
            settings.append(s)
    return settings


def machine_info() -> dict:
    """What the figures were measured on: cores, CPU model, load, versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch_version, "loadavg_at_start": os.getloadavg()}


def step_summary(steps: Sequence[StepRecord]) -> dict:
    """Step counts from the trace: how many, the biggest and the longest (the stall)."""
    if not steps:
        return {"num_steps": 0, "max_step_tokens": None, "max_step_s": None, "mean_step_s": None}
    return {"num_steps": len(steps),
            "max_step_tokens": max(s.decode_tokens + s.prefill_tokens for s in steps),
            "max_step_s": max(s.duration_s for s in steps),
            "mean_step_s": sum(s.duration_s for s in steps) / len(steps)}


def run_sweep(
    settings: Sequence[Setting],
    specs: Sequence[RequestSpec],
    out_dir: str | Path,
    opts: RunOptions,
    *,
    workload: dict,
    server_cmd: str = DEFAULT_SERVER_CMD,
    server_args: str = "",
    command: str = "",
) -> dict:
    """Run the workload against one fresh server per setting; write per-setting reports, table, pictures."""
    out = Path(out_dir)
    tmp = out / "tmp"  # server logs and step traces: git-ignored
    tmp.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    runs, timelines = [], []
    for s in settings:
        print(f"== {s.label}", file=sys.stderr, flush=True)
        trace = tmp / f"{s.slug}.steps.jsonl"
        trace.unlink(missing_ok=True)
        cost_model = tmp / f"{s.slug}.cost.json"  # each run profiles afresh, and leaves its fit for simulate
        cost_model.unlink(missing_ok=True)
        port = free_port()
        argv = server_command(server_cmd, port=port, chunk=s.prefill_chunk, budget=s.max_batch_tokens,
                              trace=trace, extra_args=s.server_args(server_args, cost_model))
        info = dict(workload, label=s.label, policy=s.policy, prefill_chunk=s.prefill_chunk,
                    max_batch_tokens=s.max_batch_tokens, tpot_target_ms=s.tpot_target_ms, server_argv=argv)
        try:
            with ServerProcess(argv, port, tmp / f"{s.slug}.log"):
                report = run_bench(f"http://127.0.0.1:{port}", specs, opts, settings=info)
        except RuntimeError as e:
            print(f"   {s.label} failed: {e}", file=sys.stderr)
            runs.append((s, {"settings": info, "error": str(e)}))
            continue
        clocks = (report["settings"]["t0_monotonic"], report["settings"]["t0_wall"])
        steps = [x for x in read_step_trace(trace, clocks) if x.start_s >= 0]  # warm-up steps left out
        report["steps"] = step_summary(steps)
        report["settings"]["loadavg_after"] = os.getloadavg()
        (out / f"{s.slug}.json").write_text(json.dumps(report, indent=1))
        plot_run(report, out / f"{s.slug}.png", title=f"{s.label}: {_run_line(report)}")
        runs.append((s, report))
        long_arrivals = [x.arrival_s for x in specs if x.kind == "long"]
        timelines.append(Timeline(s.label, steps, s.max_batch_tokens, long_arrivals))
    ok = [(s.label, r) for s, r in runs if "error" not in r]
    if ok:
        plot_sweep_ttft(ok, out / "ttft_cdf.png")
        plot_sweep_tpot(ok, out / "tpot_cdf.png", opts.stall_threshold)
    if timelines:
        plot_timelines(timelines, out / "timeline.png")
    rows = [table_row(s, r) for s, r in runs]
    plot_frontier(rows, out / "frontier.png", opts.stall_threshold)
    summary = {"command": command, "machine": machine, "workload": workload, "options": asdict(opts),
               "rows": rows, "recommended": recommend(rows)}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    (out / "sweep.md").write_text(markdown(summary))
    return summary


def _run_line(report: dict) -> str:
    short = report["classes"].get("short", {})
    return (f"{report['output_token_throughput'] or 0:.1f} output tok/s, "
            f"{short.get('stalled', 0)} of {short.get('count', 0)} short requests stalled")


def table_row(s: Setting, report: dict) -> dict:
    """The figures PERF.md's workload M table reports, plus throughput, the longest step and the check."""
    row = {"setting": s.label, "policy": s.policy, "prefill_chunk": s.prefill_chunk,
           "max_batch_tokens": s.max_batch_tokens, "tpot_target_ms": s.tpot_target_ms}
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
        max_step_s=report.get("steps", {}).get("max_step_s"),
        max_step_tokens=report.get("steps", {}).get("max_step_tokens"),
        ttft_ratio=check.get("ttft_ratio"), itl_ratio=check.get("itl_ratio"),
        agree_within_10pct=check.get("agree_within_10pct"),
    )


def recommend(rows: Sequence[dict]) -> str | None:
    """The setting with the fastest long prompts among those where no request failed and none stalled."""
    ok = [r for r in rows if "error" not in r and not r["failed"] and r["short_stalled"] == 0
          and r["long_ttft_p50_s"] is not None]
    if not ok:
        return None
    best = min(ok, key=lambda r: (r["long_ttft_p50_s"], r["short_tpot_p99_s"] or 0.0))
    return best["setting"]


def _f(x, scale: float = 1.0, fmt: str = ".0f") -> str:
    return "–" if x is None else format(x * scale, fmt)


def markdown(summary: dict) -> str:
    """The comparison table as markdown, with the machine and workload it ran on."""
    m, w = summary["machine"], summary["workload"]
    lines = [
        "# prefill_chunk sweep",
        "",
        f"Command: `{summary.get('command') or 'mixserve bench sweep'}`.",
        f"Machine: {m['nproc']} cores ({m['cpu_model']}), {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}; load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}.",
        f"Workload: {json.dumps(w)}.",
        "",
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
            f"| {_f(r['short_max_gap_s'], 1000)} | {r['short_stalled']} of {r['short_count']} "
            f"| {_f(r['short_ttft_p50_s'], 1000)}/{_f(r['short_ttft_p99_s'], 1000)} "
            f"| {_f(r['long_ttft_p50_s'], 1, '.2f')} / {_f(r['long_ttft_max_s'], 1, '.2f')} "
            f"| {_f(r['output_token_throughput'], 1, '.1f')} "
            f"| {_f(r['max_step_s'], 1000)}, {_f(r['max_step_tokens'])} "
            f"| {r['failed']} | {_f(r['ttft_ratio'], 1, '.3f')}, {_f(r['itl_ratio'], 1, '.3f')} |"
        )
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
        "Without a failed or stalled request, the fastest long prompts (TTFT p50): "
        f"**{summary.get('recommended') or 'no setting'}**.",
        "",
        "frontier.png: each setting as a point of (the short requests' worst gap, the long prompts' TTFT "
        "p50); a TPOT target's point should sit left of the stall line and as low as the big budgets'.",
        "",
    ]
    return "\n".join(lines)
