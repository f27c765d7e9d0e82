#!/usr/bin/env python3
"""Prefix caching off against on, in one run: the shared-prefix workload against two `mixserve serve`s.

The workload (mixserve/bench/workload.py `shared_prefix_workload`): N requests at R/s (Poisson), each a
shared system prompt of P random tokens then a question of its own (16-48 tokens), O output tokens. The
same workload goes to a server with `--enable-prefix-caching off`, then to one with `on` (same flags
otherwise, `--log-level info` for the engine's log line). Prints TTFT p50/p90, output tok/s, and the hit
rate the server reports: from /metrics (mixserve:prefix_cache_hits_total / _queries_total, the run's own
delta after a random-prompt warm-up) and from the engine's last log line.
Writes bench/results/prefix_cache.json.

    flock /tmp/mixserve-bench.lock .venv/bin/python bench/prefix_cache.py [--num-requests 32] [--rate 1]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import httpx  # noqa: E402

from mixserve.bench.run import RunOptions, run_bench  # noqa: E402
from mixserve.bench.server import DEFAULT_SERVER_CMD, ServerProcess, free_port, server_command  # noqa: E402
from mixserve.bench.workload import DEFAULT_VOCAB_SIZE, random_workload, shared_prefix_workload  # noqa: E402
from mixserve.config import EngineConfig  # noqa: E402

COUNTERS = ("mixserve:prefix_cache_queries_total", "mixserve:prefix_cache_hits_total")


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out = {}
    for name in COUNTERS:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def one_side(caching: bool, args: argparse.Namespace, tmp: Path) -> dict:
    specs = shared_prefix_workload(args.num_requests, args.rate, prefix_len=args.prefix_len,
                                   num_prefixes=args.num_prefixes, output_len=args.output_len, seed=args.seed)
    port = free_port()
    side = "on" if caching else "off"
    extra = f"--enable-prefix-caching {side} --log-level info {args.server_args}"
    argv = server_command(DEFAULT_SERVER_CMD, port=port, chunk=args.prefill_chunk,
                          budget=args.max_batch_tokens, trace=tmp / f"trace-{side}.jsonl", extra_args=extra)
    log = tmp / f"server-{side}.log"
    with ServerProcess(argv, port, log) as server:
        # warm-up on random prompts (nothing shared with the workload), then the counters' baseline
        run_bench(server.url, random_workload(4, float("inf"), input_len=64, output_len=4, seed=99),
                  RunOptions(vocab_size=DEFAULT_VOCAB_SIZE, warmup=0, progress=False))
        before = counters(server.url)
        report = run_bench(server.url, specs, RunOptions(vocab_size=DEFAULT_VOCAB_SIZE, warmup=0,
                                                         progress=False, max_duration_s=900.0))
        after = counters(server.url)
    queries, hits = (after[n] - before[n] for n in COUNTERS)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "prefix cache hit rate" in ln]
    return {"caching": side, "ttft_s": report["ttft_s"], "tpot_s": report["tpot_s"],
            "output_tok_s": report["output_token_throughput"], "completed": report["completed"],
            "failed": report["failed"], "duration_s": report["duration_s"], "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "hit_rate": hits / queries if queries else None,
            "engine_log_line": lines[-1] if lines else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    ap.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    ap.add_argument("--server-args", default="", help="extra `mixserve serve` flags for both servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/prefix_cache.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = [one_side(False, args, Path(tmp)), one_side(True, args, Path(tmp))]
    print(f"shared-prefix workload: {args.num_requests} requests at {args.rate}/s, prefix {args.prefix_len} "
          f"tokens x {args.num_prefixes}, questions 16-48, output {args.output_len}; chunk "
          f"{args.prefill_chunk}, budget {args.max_batch_tokens}")
    print("| caching | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | output tok/s | hit rate (/metrics) |")
    print("|---|---|---|---|---|---|")
    for s in sides:
        rate = "-" if s["hit_rate"] is None else (
            f"{100 * s['hit_rate']:.1f}% ({s['prefix_cache_hits']:.0f} of "
            f"{s['prefix_cache_queries']:.0f} tokens)")
        print(f"| {s['caching']} | {1e3 * s['ttft_s']['p50']:.0f} | {1e3 * s['ttft_s']['p90']:.0f} | "
              f"{1e3 * (s['tpot_s']['p50'] or 0):.0f} | {s['output_tok_s']:.1f} | {rate} |")
    for s in sides:
        print(f"{s['caching']}: completed {s['completed']}, failed {s['failed']}; last engine log line: "
              f"{s['engine_log_line']}")
    off, on = sides
    print(f"TTFT p50 on/off {on['ttft_s']['p50'] / off['ttft_s']['p50']:.2f}x; output tok/s on/off "
          f"{on['output_tok_s'] / off['output_tok_s']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "sides": sides}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
