#!/usr/bin/env python3
"""Workload M against a disaggregated pair (`--role prefill` + `--role decode`), and beside it one `both`
instance, each instance's step timeline from its step trace, and the decode instance's stalls.

Sized for 2 cores: the pair gets one thread (one core) per instance and the `both` instance two threads:
the same machine either way, so the comparison is of where the long prompts' prefill runs, not of more
hardware. Workload M scaled by default (12 short requests at 0.5/s and 4 long prompts of 1,500 tokens;
`--full` for 48 at 2/s), so one run of the three settings stays under 5 minutes. One pair per value of
`--min-tokens` (0,256): the decode instance's kv_peer_min_tokens (0 sends every prompt to the prefill
instance; 256 prefills the short ones on the decode instance).
Prints and writes (JSON, PNG):
  - short requests stalled (a gap over 0.5 s), max gap, TPOT p50, TTFT p50 of short and long;
  - per instance: steps, steps carrying prefill tokens, the longest step and the most prefill tokens in
    one step (the decode instance only computes each prompt's last block: 1..block_size tokens).

    flock /tmp/mixserve-bench.lock .venv/bin/python bench/disagg.py [--full] [--no-both] [--min-tokens 0,256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from mixserve.bench.plot import Timeline, plot_timelines
from mixserve.bench.run import RunOptions, run_bench
from mixserve.bench.server import ServerProcess, free_port
from mixserve.bench.trace import StepRecord, read_step_trace
from mixserve.bench.workload import DEFAULT_VOCAB_SIZE, workload_m
from mixserve.config import EngineConfig

LONG_LEN = 1500


def serve_argv(port: int, trace: Path, threads: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mixserve", "serve", "--port", str(port), "--step-trace", str(trace),
            "--threads", str(threads), "--prefill-chunk", str(EngineConfig.prefill_chunk),
            "--max-batch-tokens", str(EngineConfig.max_batch_tokens), *extra]


def run_m(url: str, full: bool, seed: int, label: str) -> tuple[dict, list]:
    short, rate = (48, 2.0) if full else (12, 0.5)
    specs = workload_m(num_short=short, short_rate=rate, short_input=(32, 128), short_output=64,
                       long_input_len=LONG_LEN, long_output=8, vocab_size=DEFAULT_VOCAB_SIZE, seed=seed)
    opts = RunOptions(vocab_size=DEFAULT_VOCAB_SIZE, max_duration_s=240.0, progress=False)
    report = run_bench(url, specs, opts, settings={"workload": "M", "setting": label, "short_requests": short,
                                                   "short_rate": rate})
    return report, [s.arrival_s for s in specs if s.kind == "long"]


def steps_of(report: dict, trace: Path) -> list[StepRecord]:
    clocks = (report["settings"]["t0_monotonic"], report["settings"]["t0_wall"])
    return [s for s in read_step_trace(trace, clocks) if s.start_s >= 0]  # warm-up steps left out


def step_summary(steps: list[StepRecord]) -> dict:
    with_prefill = [s for s in steps if s.prefill_tokens]
    return {"steps": len(steps), "steps_with_prefill": len(with_prefill),
            "max_prefill_tokens_in_a_step": max((s.prefill_tokens for s in steps), default=0),
            "longest_step_s": round(max((s.duration_s for s in steps), default=0.0), 3),
            "longest_step_with_decodes_s": round(max((s.duration_s for s in steps if s.decode_tokens),
                                                     default=0.0), 3)}


def verdict(report: dict) -> dict:
    short, long = report["classes"].get("short", {}), report["classes"].get("long", {})
    return {"failed": report.get("failed"), "short_stalled": short.get("stalled"),
            "short_count": short.get("count"), "short_max_gap_s": short.get("max_gap_s"),
            "short_tpot_p50_s": (short.get("tpot_s") or {}).get("p50"),
            "short_ttft_p50_s": (short.get("ttft_s") or {}).get("p50"),
            "long_ttft_p50_s": (long.get("ttft_s") or {}).get("p50")}


def run_pair(tmp: Path, full: bool, seed: int, min_tokens: int) -> tuple[dict, list[Timeline]]:
    peer = f"127.0.0.1:{free_port()}"
    link = ["--kv-peer", peer, "--kv-peer-min-tokens", str(min_tokens)]
    ports = {"prefill": free_port(), "decode": free_port()}
    traces = {role: tmp / f"{role}.jsonl" for role in ports}
    procs = {role: ServerProcess(serve_argv(port, traces[role], 1, ["--role", role, *link]),
                                 port, tmp / f"{role}.log") for role, port in ports.items()}
    # the prefill instance answers /health only once the decode one has connected: start it meanwhile
    starting = threading.Thread(target=procs["prefill"].start)
    starting.start()
    try:
        procs["decode"].start()
        starting.join()
        report, longs = run_m(procs["decode"].url, full, seed, "pair")
    finally:
        for p in procs.values():
            p.stop()
    result = {"verdict": verdict(report), "report": report}
    timelines = []
    for role in ("prefill", "decode"):
        steps = steps_of(report, traces[role])
        result[f"{role}_steps"] = step_summary(steps)
        label = f"pair: {role} instance (1 core)"
        timelines.append(Timeline(label, steps, EngineConfig.max_batch_tokens, longs))
    return result, timelines


def run_both(tmp: Path, full: bool, seed: int) -> tuple[dict, Timeline]:
    port, trace = free_port(), tmp / "both.jsonl"
    with ServerProcess(serve_argv(port, trace, 2, []), port, tmp / "both.log") as server:
        report, longs = run_m(server.url, full, seed, "both")
    steps = steps_of(report, trace)
    return ({"verdict": verdict(report), "both_steps": step_summary(steps), "report": report},
            Timeline("both (one instance, 2 cores)", steps, EngineConfig.max_batch_tokens, longs))


def line(label: str, v: dict) -> str:
    def s(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    return (f"{label}: short stalled {v['short_stalled']} of {v['short_count']} (max gap "
            f"{s(v['short_max_gap_s'])} s), short TPOT p50 {s(v['short_tpot_p50_s'])} s, short TTFT p50 "
            f"{s(v['short_ttft_p50_s'])} s, long TTFT p50 {s(v['long_ttft_p50_s'])} s, failed {v['failed']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="workload M as specified (48 short at 2/s)")
    ap.add_argument("--no-both", action="store_true", help="skip the one-instance run beside the pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", default="0,256",
                    help="the decode instance's kv_peer_min_tokens, one pair per comma-separated value "
                         "(0: every prompt goes to the prefill instance)")
    ap.add_argument("--out", default="bench/results/disagg.json")
    args = ap.parse_args()
    min_tokens = [int(v) for v in args.min_tokens.split(",")]
    out: dict = {"settings": {"full": args.full, "seed": args.seed, "long_len": LONG_LEN,
                              "kv_peer_min_tokens": min_tokens}, "pairs": {}}
    timelines: list[Timeline] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in min_tokens:
            pair, panels = run_pair(Path(tmp), args.full, args.seed, n)
            out["pairs"][str(n)] = pair
            timelines += [replace(p, label=f"{p.label}, kv_peer_min_tokens {n}") for p in panels]
            print(line(f"pair (prefill + decode, 1 core each, kv_peer_min_tokens {n})", pair["verdict"]))
            for role in ("prefill", "decode"):
                print(f"  {role} instance steps: {json.dumps(pair[f'{role}_steps'])}")
        if not args.no_both:
            both, timeline = run_both(Path(tmp), args.full, args.seed)
            out["both"] = both
            timelines.append(timeline)
            print(line("both (one instance, 2 cores)", both["verdict"]))
            print(f"  both instance steps: {json.dumps(both['both_steps'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot_timelines(timelines, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
