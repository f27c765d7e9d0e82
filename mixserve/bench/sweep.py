"""`bench sweep`: one server per (prefill_chunk, max_batch_tokens) setting, the same workload against
each (in interleaved rounds when repeated), then one comparison table (markdown + JSON, built by
sweep_report) and the pictures."""

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
from mixserve.bench.sweep_report import markdown, median_row, recommend, table_row
from mixserve.bench.trace import StepRecord, read_step_trace
from mixserve.bench.workload import RequestSpec


@dataclass(frozen=True)
class Setting:
    """One server configuration of the sweep; prefill_chunk 0 is WholePrompt; a TPOT target (ms) > 0 sizes
    the chunks itself (prefill_chunk is then moot); slo_mode: the server serves to the sweep's SLOs
    (`--slo-ttft-ms`, `--slo-tpot-ms`: docs/serving-to-an-slo.md)."""

    prefill_chunk: int
    max_batch_tokens: int
    tpot_target_ms: float = 0
    slo_mode: str = ""  # "" or the server's SLO flags, e.g. "--slo-ttft-ms 2000 --slo-tpot-ms 200"

    @property
    def policy(self) -> str:
        if self.slo_mode:
            return "SLO"
        if self.tpot_target_ms:
            return f"TpotTarget({self.tpot_target_ms:g} ms)"
        return f"Chunked({self.prefill_chunk})" if self.prefill_chunk else "WholePrompt"

    @property
    def label(self) -> str:
        what = f"chunk {self.prefill_chunk}" if self.prefill_chunk else "WholePrompt"
        if self.tpot_target_ms:
            what = f"target {self.tpot_target_ms:g} ms"
        if self.slo_mode:
            what = "SLO mode"
        return f"{what}, budget {self.max_batch_tokens}"

    @property
    def slug(self) -> str:
        what = f"chunk{self.prefill_chunk}" if self.prefill_chunk else "whole"
        if self.tpot_target_ms:
            what = f"tpot{self.tpot_target_ms:g}"
        if self.slo_mode:
            what = "slo"
        return f"{what}-b{self.max_batch_tokens}"

    def server_args(self, extra: str, cost_model: Path) -> str:
        """Extra server flags: the target, and where the server writes its cost model on shutdown."""
        target = f" --tpot-target-ms {self.tpot_target_ms:g}" if self.tpot_target_ms else ""
        target += f" {self.slo_mode}" if self.slo_mode else ""
        return f"{extra}{target} --cost-model {shlex.quote(str(cost_model))}"


def parse_settings(spec: str, budget: int, whole_prompt_budget: int = 0, targets: str = "",
                   slo_flags: str = "") -> list[Setting]:
    """Settings from "0,16,64,256" (each at `budget`; "CHUNK:BUDGET" sets its own).

    A chunk larger than its budget is capped to it (the budget caps every step anyway). whole_prompt_budget
    > 0 adds WholePrompt at that budget first: the big-budget case where a long prompt shares a step with
    the decodes and stalls them, which chunking exists to fix. `targets` ("0,200,400") adds one setting
    per TPOT target > 0 at `budget` (0 is the fixed settings themselves); `slo_flags` (the server's SLO
    flags) adds the SLO mode at `budget`, last.
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
    if slo_flags:
        settings.append(Setting(budget, budget, slo_mode=slo_flags))
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


@dataclass
class SettingRun:
    """One run of one setting: its bench report (or {"settings", "error"} if it could not run) and, when
    it ran, its step timeline."""

    report: dict
    timeline: Timeline | None = None


def run_setting(s: Setting, specs: Sequence[RequestSpec], out: Path, opts: RunOptions, *, tag: str,
                info: dict, server_cmd: str, server_args: str) -> SettingRun:
    """One fresh server for `s`, the workload against it; its report, picture, log, step trace and cost
    model are named by `tag` (the slug, with the round when a setting repeats)."""
    tmp = out / "tmp"  # server logs and step traces: git-ignored
    trace = tmp / f"{tag}.steps.jsonl"
    trace.unlink(missing_ok=True)
    cost_model = tmp / f"{tag}.cost.json"  # each run profiles afresh, and leaves its fit for simulate
    cost_model.unlink(missing_ok=True)
    port = free_port()
    argv = server_command(server_cmd, port=port, chunk=s.prefill_chunk, budget=s.max_batch_tokens,
                          trace=trace, extra_args=s.server_args(server_args, cost_model))
    info = dict(info, server_argv=argv)
    try:
        with ServerProcess(argv, port, tmp / f"{tag}.log"):
            report = run_bench(f"http://127.0.0.1:{port}", specs, opts, settings=info)
    except RuntimeError as e:
        print(f"   {s.label} failed: {e}", file=sys.stderr)
        return SettingRun({"settings": info, "error": str(e)})
    clocks = (report["settings"]["t0_monotonic"], report["settings"]["t0_wall"])
    steps = [x for x in read_step_trace(trace, clocks) if x.start_s >= 0]  # warm-up steps left out
    report["steps"] = step_summary(steps)
    report["settings"]["loadavg_after"] = os.getloadavg()
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1))
    plot_run(report, out / f"{tag}.png", title=f"{s.label}: {_run_line(report)}")
    long_arrivals = [x.arrival_s for x in specs if x.kind == "long"]
    return SettingRun(report, Timeline(s.label, steps, s.max_batch_tokens, long_arrivals))


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
    repeats: int = 1,
) -> dict:
    """Run the workload against one fresh server per setting, `repeats` rounds of every setting in turn;
    write per-run reports, the table of per-setting medians, and pictures.

    Rounds interleave the settings (A B C, A B C; not A A, B B, C C): a machine's speed can drift over
    minutes as much as the settings differ, so only repeats spread alike over the drift compare settings
    fairly (docs/decisions/interleaved-rounds.md).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = Path(out_dir)
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    runs: dict[Setting, list[SettingRun]] = {s: [] for s in settings}
    for k in range(1, repeats + 1):
        for s in settings:
            print(f"== {s.label}" + (f" (round {k} of {repeats})" if repeats > 1 else ""), file=sys.stderr,
                  flush=True)
            info = dict(workload, label=s.label, policy=s.policy, prefill_chunk=s.prefill_chunk,
                        max_batch_tokens=s.max_batch_tokens, tpot_target_ms=s.tpot_target_ms, round=k)
            tag = s.slug if repeats == 1 else f"{s.slug}-r{k}"
            runs[s].append(run_setting(s, specs, out, opts, tag=tag, info=info, server_cmd=server_cmd,
                                       server_args=server_args))
    # the CDFs and timelines draw each setting's first run that completed: one curve per setting
    drawn = [next((r for r in rs if r.timeline is not None), None) for rs in runs.values()]
    ok = [(s.label, r.report) for s, r in zip(runs, drawn, strict=True) if r is not None]
    if ok:
        plot_sweep_ttft(ok, out / "ttft_cdf.png")
        plot_sweep_tpot(ok, out / "tpot_cdf.png", opts.stall_threshold)
    timelines = [r.timeline for r in drawn if r is not None and r.timeline is not None]
    if timelines:
        plot_timelines(timelines, out / "timeline.png")
    rows = [median_row([table_row(s, r.report) for r in rs]) for s, rs in runs.items()]
    plot_frontier(rows, out / "frontier.png", opts.stall_threshold,
                  runs=[x for r in rows for x in r["runs"]] if repeats > 1 else ())
    summary = {"command": command, "machine": machine, "workload": workload, "options": asdict(opts),
               "repeats": repeats, "rows": rows, "recommended": recommend(rows)}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    (out / "sweep.md").write_text(markdown(summary))
    return summary


def _run_line(report: dict) -> str:
    short = report["classes"].get("short", {})
    return (f"{report['output_token_throughput'] or 0:.1f} output tok/s, "
            f"{short.get('stalled', 0)} of {short.get('count', 0)} short requests stalled")
