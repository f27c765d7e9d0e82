"""`mixserve simulate`: a workload through the real scheduler on a step cost model, no weights; prints the
report `mixserve bench` prints. `--profile` first measures the model on this machine and writes the file."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mixserve.bench.report import STALL_THRESHOLD_S, build_report, format_summary
from mixserve.bench.step_noise import StepNoise
from mixserve.cli.bench import add_workload_flags, build_workload
from mixserve.config import ConfigError, add_engine_flags, config_from_args
from mixserve.core.cost_model import StepCostModel

PROFILE_SECONDS = 20.0


def register(subparsers: Any) -> None:
    """Add the `simulate` subcommand."""
    # resolve: the workload's --seed (what is sent) replaces the engine's sampler --seed, moot here
    p = subparsers.add_parser(
        "simulate", conflict_handler="resolve",
        help="replay a workload through the scheduler on a step cost model (no weights, seconds)",
        description="Replay a workload (the bench's, or --requests JSONL) through the real scheduler; each "
                    "step lasts what the cost model (--cost-model FILE, written by `serve` on shutdown or by "
                    "--profile) predicts. Prints the report of `mixserve bench`.")
    add_engine_flags(p)  # --cost-model, --prefill-chunk, --max-batch-tokens, --tpot-target-ms, ...
    add_workload_flags(p, "M")
    p.add_argument("--requests", metavar="JSONL",
                   help='a JSONL of {"arrival_s", "prompt_len", "output_len", "kind"} lines (instead of a '
                        "bench workload)")
    p.add_argument("--profile", action="store_true",
                   help="load the model (--model, --dtype, --threads), time synthetic steps, write the cost "
                        "model to --cost-model, then simulate")
    p.add_argument("--profile-seconds", type=float, default=PROFILE_SECONDS,
                   help="the profile's time bound (default %(default)s)")
    p.add_argument("--stall-threshold", type=float, default=STALL_THRESHOLD_S,
                   help="a gap between two tokens over this many seconds is a stall (default %(default)s)")
    p.add_argument("--noise-from", nargs="+", metavar="TRACE",
                   help="step traces of TPOT-target runs (--step-trace): each simulated step's time is the "
                        "model's times a measured / predicted ratio drawn from them (bench/step_noise.py)")
    p.add_argument("--seeds", type=int, default=1,
                   help="with --noise-from: replay this many noise seeds and print each one's stalls and "
                        "long-prompt TTFT (the report is the first seed's; default %(default)s)")
    p.add_argument("--spec-acceptance", type=float, default=0.7, metavar="RATE",
                   help="with --speculative ngram: the chance a draft token is kept once the ones before it "
                        "were (a live run's accepted / tested drafts; default 0.7)")
    p.add_argument("--slo-ttft", type=float, help="goodput: TTFT SLO in seconds (default: --slo-ttft-ms)")
    p.add_argument("--slo-tpot", type=float, help="goodput: TPOT SLO in seconds (default: --slo-tpot-ms)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write the bench's picture of the run (CDFs, tokens over time) here")
    p.add_argument("--timeline", help="write the step timeline picture here")
    p.set_defaults(func=simulate_command)


def profile_to_file(cfg: Any, path: str, seconds: float) -> StepCostModel:
    """Load the model, time synthetic steps on its scratch KV blocks, and write the fit to `path`."""
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.engine.step_cost import profile

    engine = LLMEngine.from_config(replace(cfg, tpot_target_ms=0, cost_model="", step_trace=""))
    engine._bind_this_thread()  # as the step loop runs: this thread's pool, bound
    model = StepCostModel()
    n = engine.num_blocks
    timed = profile(engine.runner, model, list(range(max(0, n - 2048), n)), cfg.max_batch_tokens,
                    cfg.max_num_seqs, budget_s=seconds)
    model.save(path, source="profile", steps=timed, model=cfg.model or "default", dtype=cfg.dtype)
    print(f"mixserve simulate: profiled {timed} steps -> {path}", file=sys.stderr)
    return model


def simulate_command(args: argparse.Namespace) -> int:
    from mixserve.bench.simulate import SimSettings, load_requests, simulate

    try:
        cfg = config_from_args(args).engine
        if not cfg.cost_model:
            raise ValueError("--cost-model FILE is required (written by `serve --cost-model` or --profile)")
        if args.profile:
            model = profile_to_file(cfg, cfg.cost_model, args.profile_seconds)
        else:
            model = StepCostModel.load(cfg.cost_model)
        if args.requests:
            specs = load_requests(args.requests)
            desc: dict = {"workload": "requests", "requests": args.requests, "num_requests": len(specs)}
        else:
            specs, desc = build_workload(args)
        settings = SimSettings.from_engine_config(cfg)
        if args.seeds < 1 or (args.seeds > 1 and not args.noise_from):
            raise ValueError("--seeds must be >= 1, and more than 1 needs --noise-from (without noise every "
                             "seed replays the same run)")
        noise = StepNoise.from_traces(args.noise_from) if args.noise_from else None
        runs = [simulate(specs, model.coefficients, settings, noise, seed, args.spec_acceptance)
                for seed in range(args.seeds)]
    except (ConfigError, ValueError, OSError) as e:
        print(f"mixserve simulate: {e}", file=sys.stderr)
        return 2
    run = runs[0]
    reports = [simulated_report(r, desc, settings, model, cfg.cost_model, args.stall_threshold,
                                (args.slo_ttft, args.slo_tpot)) for r in runs]
    report = reports[0]
    if noise is not None:
        report["noise"] = {"traces": args.noise_from, "seeds": seed_rows(reports)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot or args.timeline:
        from mixserve.bench.plot import Timeline, plot_run, plot_timelines

        if args.plot:
            plot_run(report, args.plot, title=f"simulated: {settings_label(settings)}")
        if args.timeline:
            longs = [x.arrival_s for x in specs if x.kind == "long"]
            plot_timelines([Timeline(f"simulated: {settings_label(settings)}", run.steps,
                                     settings.max_batch_tokens, longs)], args.timeline)
    print(format_summary(report))
    if noise is not None:
        print(noise.describe())
        print(format_seeds(report["noise"]["seeds"]))
    return 0


def seed_rows(reports: list[dict]) -> list[dict]:
    """Per noise seed: the short requests' stalls and worst gap, the long prompts' TTFT p50."""
    rows = []
    for seed, r in enumerate(reports):
        short, long = r["classes"].get("short", {}), r["classes"].get("long", {})
        rows.append({"seed": seed, "stalled": short.get("stalled"), "max_gap_s": short.get("max_gap_s"),
                     "long_ttft_p50_s": (long.get("ttft_s") or {}).get("p50")})
    return rows


def format_seeds(rows: list[dict]) -> str:
    """Lines of per-seed figures and their spread over seeds."""
    stalled = [r["stalled"] for r in rows if r["stalled"] is not None]
    longs = sorted(r["long_ttft_p50_s"] for r in rows if r["long_ttft_p50_s"] is not None)
    lines = [f"noise seed {r['seed']}: stalled {r['stalled']}, max gap {1000 * (r['max_gap_s'] or 0):.0f} ms"
             + (f", long TTFT p50 {r['long_ttft_p50_s']:.2f} s" if r["long_ttft_p50_s"] is not None else "")
             for r in rows]
    if stalled:
        lines.append(f"over {len(rows)} seeds: stalled none in {sum(x == 0 for x in stalled)}, median "
                     f"stalled {statistics.median(stalled):g}"
                     + (f", long TTFT p50 median {statistics.median(longs):.2f} s" if longs else ""))
    return "\n".join(lines)


def settings_label(s: Any) -> str:
    what = f"chunk {s.prefill_chunk}" if s.prefill_chunk else "WholePrompt"
    if s.tpot_target_ms:
        what = f"target {s.tpot_target_ms:g} ms"
    if s.slo_ttft_ms or s.slo_tpot_ms:
        what = f"SLO mode (TTFT {s.slo_ttft_ms:g} ms, TPOT {s.slo_tpot_ms:g} ms)"
    return f"{what}, budget {s.max_batch_tokens}"


def simulated_report(run: Any, desc: dict, settings: Any, model: StepCostModel, path: str,
                     stall_threshold: float, slo: tuple[float | None, float | None] = (None, None)) -> dict:
    """The bench's JSON report of a simulated run, with its steps and the cost model it used."""
    from mixserve.bench.run import request_records
    from mixserve.bench.sweep import step_summary

    info = dict(desc, simulated=True, label=settings_label(settings), cost_model=path,
                cost_coefficients=asdict(model.coefficients), **asdict(settings))
    # with an SLO set, goodput counts the requests that met it (the bench's --slo-ttft / --slo-tpot)
    slo_ttft = slo[0] if slo[0] is not None else settings.slo_ttft_ms / 1000 or None
    slo_tpot = slo[1] if slo[1] is not None else settings.slo_tpot_ms / 1000 or None
    report = build_report(run.results, run.duration_s, settings=info, stall_threshold=stall_threshold,
                          slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    report["requests"] = request_records(run.results)
    report["steps"] = step_summary(run.steps)
    return report
