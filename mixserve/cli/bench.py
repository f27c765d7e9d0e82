"""`mixserve bench`: drive an OpenAI-compatible server over HTTP; `mixserve bench sweep`: one server per
prefill_chunk setting, the same workload against each, a comparison table and pictures."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mixserve.bench.report import STALL_THRESHOLD_S, format_summary
from mixserve.bench.run import RunOptions
from mixserve.bench.workload import (
    DEFAULT_VOCAB_SIZE,
    RequestSpec,
    load_dataset,
    random_workload,
    shared_prefix_workload,
    workload_m,
)

# What each workload uses for a flag that was not given: random's own, and PERF.md's workload M.
RANDOM_DEFAULTS = {"num_requests": 100, "request_rate": float("inf"), "input_len": 128,
                   "input_len_range": 0.0, "output_len": 64, "long_input_len": 1500, "long_output_len": None}
M_DEFAULTS = {"num_requests": 48, "request_rate": 2.0, "input_len": 80, "input_len_range": 0.6,
              "output_len": 64, "long_input_len": 1500, "long_output_len": 8}
# shared-prefix: --input-len is the question after the shared prefix (--prefix-len tokens)
SHARED_DEFAULTS = {**RANDOM_DEFAULTS, "num_requests": 32, "request_rate": 1.0, "input_len": 32,
                   "input_len_range": 0.5, "output_len": 32}


def _rate(text: str) -> float:
    value = float(text)  # "inf" parses: every request at once
    if value <= 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return value


def add_workload_flags(p: argparse.ArgumentParser, default_workload: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("random", "M", "shared-prefix"), default=default_workload,
                   help="random token prompts, PERF.md's mixed workload M, or shared-prefix: a long shared "
                   "system prompt before each short question (default %(default)s)")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: its tokens (default 512)")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct prefixes, used round robin (default 1)")
    g.add_argument("--dataset", default="random", help="'random', or a JSONL file of {\"prompt\": ...} lines")
    g.add_argument("--num-requests", type=int, help="requests (workload M: short requests; default 100 / 48)")
    g.add_argument("--request-rate", type=_rate, help="Poisson arrivals per second; inf = all at once "
                   "(default inf / M: 2)")
    g.add_argument("--input-len", type=int, help="prompt tokens (default 128 / M: 80)")
    g.add_argument("--input-len-range", type=float, help="prompts uniform in L*(1-F)..L*(1+F) "
                   "(default 0 / M: 0.6, i.e. 32-128)")
    g.add_argument("--output-len", type=int, help="output tokens per request (default 64)")
    g.add_argument("--long-prompt-fraction", type=float, default=0.0,
                   help="random workload: this fraction of requests get long prompts (default 0)")
    g.add_argument("--long-input-len", type=int, help="long prompt tokens (default 1500)")
    g.add_argument("--long-output-len", type=int,
                   help="long requests' output tokens (default --output-len / M: 8)")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="random token ids are drawn below this (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="the workload's random seed (default 0)")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--model", help="model name sent in requests (default: the first of /v1/models)")
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g.add_argument("--slo-ttft", type=float, help="goodput: TTFT SLO in seconds")
    g.add_argument("--slo-tpot", type=float, help="goodput: TPOT SLO in seconds")
    g.add_argument("--stall-threshold", type=float, default=STALL_THRESHOLD_S,
                   help="a gap between two tokens over this many seconds is a stall (default %(default)s)")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first (default 2)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s (default 600)")
    g.add_argument("--logprobs", type=int, help="request N logprobs per token: servers that hold back "
                   "incomplete text then still stream one chunk per token (exact inter-token gaps)")
    g.add_argument("--max-duration", type=float, help="cancel requests unfinished this many seconds "
                   "after the start; they count as failed (bench default: none; sweep: 90 per setting)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="load bench: TTFT, TPOT and stalls of a server over HTTP",
                              description="Drive an OpenAI-compatible server (streaming /v1/completions).")
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG of the run here")
    add_workload_flags(p, "random")
    add_run_flags(p)
    p.set_defaults(func=bench_command)
    sub = p.add_subparsers(dest="bench_command", metavar="sweep")
    s = sub.add_parser("sweep", help="one server per prefill_chunk setting, one comparison table",
                       conflict_handler="resolve",  # --request-rate: a list here
                       description="Start a server per setting, run the same workload against each, and "
                       "write a comparison table (markdown + JSON) with TTFT/TPOT CDFs and step timelines.")
    s.add_argument("--prefill-chunk", default="0,16,64,256",
                   help="comma-separated chunks (0 = WholePrompt), CHUNK:BUDGET for its own budget")
    s.add_argument("--max-batch-tokens", type=int, default=512,
                   help="the token budget of each setting; chunks above it are capped (default 512)")
    s.add_argument("--whole-prompt-budget", type=int, default=2048,
                   help="also run WholePrompt at this big budget, the stall case (0 = skip; default 2048)")
    s.add_argument("--tpot-target-ms", default="",
                   help="comma-separated TPOT targets, each a setting at --max-batch-tokens (0 = none)")
    s.add_argument("--repeats", type=int, default=1,
                   help="run every setting this many times, interleaved (round 1 runs each setting once, "
                   "then round 2, ...); the table gives each setting's medians and every run (default 1)")
    s.add_argument("--server-cmd", default=None,
                   help="server command template with {python} {port} {chunk} {budget} {trace}")
    s.add_argument("--server-args", default="", help="extra server flags, e.g. '--model PATH'")
    s.add_argument("--out-dir", default="bench/results", help="where the results go (default %(default)s)")
    add_workload_flags(s, "M")
    s.add_argument("--request-rate", default=None, help="Poisson arrivals per second (M: the short "
                   "requests'); a list '0.5,1,2' runs the sweep at each and draws goodput against the rate "
                   "(goodput.png; needs --slo-ttft or --slo-tpot)")
    s.add_argument("--slo-mode", action="store_true", help="also run the SLO mode at --max-batch-tokens, "
                   "serving to --slo-ttft / --slo-tpot (docs/serving-to-an-slo.md)")
    add_run_flags(s)
    s.set_defaults(func=sweep_command, max_duration=90.0)


def _resolve(args: argparse.Namespace) -> dict:
    defaults = {"M": M_DEFAULTS, "shared-prefix": SHARED_DEFAULTS}.get(args.workload, RANDOM_DEFAULTS)
    if isinstance(args.request_rate, str):  # the sweep's list, here of one rate
        args = argparse.Namespace(**{**vars(args), "request_rate": _rate(args.request_rate)})
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}


def build_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], dict]:
    """The specs the flags describe, and a description of them for the report."""
    w = _resolve(args)
    if args.dataset != "random":
        specs = load_dataset(args.dataset, args.num_requests or 0, w["request_rate"],
                             output_len=w["output_len"], seed=args.seed)
        desc = {"workload": "dataset", "dataset": args.dataset, "request_rate": w["request_rate"]}
    elif args.workload == "M":
        lo = max(1, round(w["input_len"] * (1 - w["input_len_range"])))
        hi = max(lo, round(w["input_len"] * (1 + w["input_len_range"])))
        specs = workload_m(num_short=w["num_requests"], short_rate=w["request_rate"], short_input=(lo, hi),
                           short_output=w["output_len"], long_input_len=w["long_input_len"],
                           long_output=w["long_output_len"], vocab_size=args.vocab_size, seed=args.seed)
        desc = {"workload": "M", "short_requests": w["num_requests"], "short_rate": w["request_rate"],
                "short_prompt_tokens": [lo, hi], "short_output_tokens": w["output_len"],
                "long_prompts": 4, "long_prompt_tokens": w["long_input_len"],
                "long_output_tokens": w["long_output_len"], "long_at_span_fractions": [0.2, 0.4, 0.6, 0.8]}
    elif args.workload == "shared-prefix":
        lo = max(1, round(w["input_len"] * (1 - w["input_len_range"])))
        hi = max(lo, round(w["input_len"] * (1 + w["input_len_range"])))
        specs = shared_prefix_workload(w["num_requests"], w["request_rate"], prefix_len=args.prefix_len,
                                       num_prefixes=args.num_prefixes, question_len=(lo, hi),
                                       output_len=w["output_len"], vocab_size=args.vocab_size, seed=args.seed)
        desc = {"workload": "shared-prefix", "prefix_tokens": args.prefix_len,
                "num_prefixes": args.num_prefixes, "question_tokens": [lo, hi], **w}
    else:
        specs = random_workload(w["num_requests"], w["request_rate"], input_len=w["input_len"],
                                input_len_range=w["input_len_range"], output_len=w["output_len"],
                                long_prompt_fraction=args.long_prompt_fraction,
                                long_input_len=w["long_input_len"], long_output_len=w["long_output_len"],
                                vocab_size=args.vocab_size, seed=args.seed)
        desc = {"workload": "random", **w, "long_prompt_fraction": args.long_prompt_fraction}
    desc["seed"] = args.seed
    desc["num_requests"] = len(specs)
    return specs, desc


def run_options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(model=args.model, max_concurrency=args.max_concurrency, slo_ttft=args.slo_ttft,
                      slo_tpot=args.slo_tpot, stall_threshold=args.stall_threshold, warmup=args.warmup,
                      vocab_size=args.vocab_size, timeout_s=args.timeout, logprobs=args.logprobs,
                      max_duration_s=args.max_duration, progress=not args.no_progress)


def bench_command(args: argparse.Namespace) -> int:
    from mixserve.bench.run import run_bench  # lazily: `mixserve serve` need not import the bench

    if not args.url or not args.out:
        print("mixserve bench: --url and --out are required (or use `mixserve bench sweep`)", file=sys.stderr)
        return 2
    specs, desc = build_workload(args)
    try:
        report = run_bench(args.url, specs, run_options(args), settings=desc)
    except RuntimeError as e:
        print(f"mixserve bench: {e}", file=sys.stderr)
        return 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        from mixserve.bench.plot import plot_run

        plot_run(report, args.plot)
    print(format_summary(report))
    return 0 if report["completed"] else 1


def slo_flags(args: argparse.Namespace) -> str:
    """The server flags of the SLO mode from the bench's SLOs in seconds ("" without --slo-mode)."""
    if not args.slo_mode:
        return ""
    if args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--slo-mode needs --slo-ttft or --slo-tpot (the SLOs it serves to)")
    ms = [round(1000 * (x or 0), 3) for x in (args.slo_ttft, args.slo_tpot)]
    return f"--slo-ttft-ms {ms[0]:g} --slo-tpot-ms {ms[1]:g}"


def sweep_command(args: argparse.Namespace) -> int:
    from mixserve.bench.goodput_sweep import parse_rates, run_rates
    from mixserve.bench.server import DEFAULT_SERVER_CMD
    from mixserve.bench.sweep import parse_settings, run_sweep

    try:
        settings = parse_settings(args.prefill_chunk, args.max_batch_tokens, args.whole_prompt_budget,
                                  args.tpot_target_ms, slo_flags(args))
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        rates = parse_rates(args.request_rate) if args.request_rate is not None else [None]
        if len(rates) > 1 and args.slo_ttft is None and args.slo_tpot is None:
            raise ValueError("several --request-rate values draw goodput: give --slo-ttft or --slo-tpot")
    except ValueError as e:
        print(f"mixserve bench sweep: {e}", file=sys.stderr)
        return 2
    command = "mixserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else ""

    def sweep_at(rate: float | None, out_dir: str | Path) -> dict:
        specs, desc = build_workload(argparse.Namespace(**{**vars(args), "request_rate": rate}))
        return run_sweep(settings, specs, out_dir, run_options(args), workload=desc,
                         server_cmd=args.server_cmd or DEFAULT_SERVER_CMD, server_args=args.server_args,
                         command=command, repeats=args.repeats)

    if len(rates) == 1:  # one rate: one sweep, the layout as ever
        summary = sweep_at(rates[0], args.out_dir)
        print((Path(args.out_dir) / "sweep.md").read_text())
        return 0 if any("error" not in r for r in summary["rows"]) else 1
    run_rates(rates, sweep_at, args.out_dir)  # type: ignore[arg-type]
    print((Path(args.out_dir) / "goodput.md").read_text())
    return 0
