#!/usr/bin/env python3
"""Workload M against one `mixserve serve`, with the CPU fast path issue's two criteria side by side.

Starts a server (`--prefill-chunk 256 --max-batch-tokens 512` unless told otherwise), runs workload M
(48 streamed short requests at 2/s and four 1,500-token prompts at 20/40/60/80% of the span; `--scaled`
for the 12-at-0.5/s variant of `make bench`), then sends a fresh 1,500-token prompt alone three times
(streamed, max_tokens 1) and prints:
  - short requests stalled (a gap over 0.5 s): target 0;
  - long prompts' TTFT p50 under M / the median TTFT of one alone: target <= 1.5;
  - /health latency, polled every 50 ms during M: p99 target < 50 ms.

    .venv/bin/python bench/workload_m.py [--scaled] [--server-args "--dtype bfloat16"] [--url URL]
    .venv/bin/python bench/workload_m.py --vllm ~/peers-work --max-batch-tokens 256   # the peer, same client

`--vllm WORK` serves vLLM-CPU (../shared/peers/setup_vllm.sh's WORK) instead, fp32, with
`--max-num-batched-tokens` = --max-batch-tokens, through ../shared/peers/vllm_serve.sh.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floors import cpu_flags  # noqa: E402
from serve_overhead import percentiles, poll_health  # noqa: E402

from mixserve.bench.report import format_summary  # noqa: E402
from mixserve.bench.run import RunOptions, run_bench  # noqa: E402
from mixserve.bench.server import DEFAULT_SERVER_CMD, ServerProcess, free_port, server_command  # noqa: E402
from mixserve.bench.workload import DEFAULT_VOCAB_SIZE, RequestSpec, random_tokens, workload_m  # noqa: E402
from mixserve.config import EngineConfig  # noqa: E402

LONG_LEN, ALONE_REPEATS = 1500, 3
VLLM_SERVE = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm_serve.sh"


def run_m(url: str, scaled: bool, seed: int) -> dict:
    """Workload M's report, with the /health latencies polled meanwhile under "health_s"."""
    short, rate = (12, 0.5) if scaled else (48, 2.0)
    specs = workload_m(num_short=short, short_rate=rate, short_input=(32, 128), short_output=64,
                       long_input_len=LONG_LEN, long_output=8, vocab_size=DEFAULT_VOCAB_SIZE, seed=seed)
    opts = RunOptions(vocab_size=DEFAULT_VOCAB_SIZE, max_duration_s=600.0)
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(url, 0.05, stop, latencies))
    poller.start()
    try:
        report = run_bench(url, specs, opts, settings={"workload": "M", "short_requests": short,
                                                       "short_rate": rate})
    finally:
        stop.set()
        poller.join()
    report["health_s"] = percentiles(latencies)
    return report


def alone_specs() -> list[RequestSpec]:
    """ALONE_REPEATS fresh random 1,500-token prompts, max_tokens 1, none of them M's: M's own long prompt
    would be in the server's prefix cache (on by default) and come back at once, no measure of a prefill."""
    return [RequestSpec(i, 0.0, random_tokens(LONG_LEN, DEFAULT_VOCAB_SIZE, random.Random(f"alone-{i}")),
                        LONG_LEN, 1, "long") for i in range(ALONE_REPEATS)]


def alone_ttfts(url: str) -> list[float]:
    """TTFT of each of alone_specs() sent alone, one at a time."""
    specs = alone_specs()
    alone = run_bench(url, specs, RunOptions(vocab_size=DEFAULT_VOCAB_SIZE, max_concurrency=1, warmup=0,
                                             progress=False))
    # start and token times are seconds since the bench began: TTFT = first token - start
    return [r["token_times"][0] - r["start"] for r in alone["requests"] if r["ok"] and r["token_times"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an already running server (else one is started here)")
    ap.add_argument("--scaled", action="store_true", help="12 short requests at 0.5/s (make bench's M)")
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    ap.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    ap.add_argument("--server-args", default="", help="extra `mixserve serve` flags")
    ap.add_argument("--vllm", metavar="WORK", help="serve vLLM-CPU from setup_vllm.sh's WORK instead (fp32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/workload_m.json")
    args = ap.parse_args()
    print("cpu:", json.dumps(cpu_flags()))
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            report = run_m(args.url, args.scaled, args.seed)
            alone = alone_ttfts(args.url)
        else:
            port = free_port()
            template = DEFAULT_SERVER_CMD
            if args.vllm:  # prefill_chunk is vLLM's own choice: it chunks to what the budget leaves
                template = (f"bash {VLLM_SERVE} {Path(args.vllm).expanduser()} {{port}} --dtype float32 "
                            "--max-num-batched-tokens {budget}")
            argv = server_command(template, port=port, chunk=args.prefill_chunk,
                                  budget=args.max_batch_tokens, trace=Path(tmp) / "trace.jsonl",
                                  extra_args=args.server_args)
            with ServerProcess(argv, port, Path(tmp) / "server.log") as server:
                report = run_m(server.url, args.scaled, args.seed)
                alone = alone_ttfts(server.url)
    print(format_summary(report))
    short, long = report["classes"].get("short", {}), report["classes"].get("long", {})
    long_p50 = (long.get("ttft_s") or {}).get("p50")
    alone_median = statistics.median(alone) if alone else float("nan")
    ratio = long_p50 / alone_median if long_p50 else float("nan")
    verdict = {
        "server": "vllm" if args.vllm else "mixserve", "prefill_chunk": args.prefill_chunk,
        "max_batch_tokens": args.max_batch_tokens, "server_args": args.server_args,
        "short_stalled": short.get("stalled"), "short_count": short.get("count"),
        "short_max_gap_s": short.get("max_gap_s"), "long_ttft_p50_s": long_p50,
        "alone_ttft_s": alone, "long_over_alone": ratio,
        "stall_target_met": short.get("stalled") == 0, "ttft_target_met": ratio <= 1.5,
        "health_p99_s": report["health_s"]["p99"], "health_target_met": report["health_s"]["p99"] < 0.05,
    }
    print(f"server: {'vLLM-CPU' if args.vllm else 'mixserve'} chunk {args.prefill_chunk} budget "
          f"{args.max_batch_tokens}")
    print(f"short stalled {short.get('stalled')} of {short.get('count')} (target 0; max gap "
          f"{short.get('max_gap_s') or 0:.2f} s); long TTFT p50 {long_p50 or float('nan'):.2f} s vs alone "
          f"{alone_median:.2f} s (median of {len(alone)}): {ratio:.2f}x (target <= 1.5x); /health p99 "
          f"{1e3 * report['health_s']['p99']:.1f} ms over {report['health_s']['count']} GETs "
          "(target < 50 ms)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"report": report, "verdict": verdict}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
