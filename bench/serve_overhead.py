"""What the server adds to a decode step: the same decode batch offline and through `mixserve serve`.

N (32) requests of the same random prompts (64 tokens, seed 0), 48 output tokens each, greedy, ignore_eos,
all at once, run both ways, one after the other (`--rounds R` alternates them R times and keeps each side's
best round), each in a process of its own:
- offline: LLM.generate in a child process, with the step trace on, on the thread that loaded the model
  as users call it (`--offline-thread`: from a fresh thread, as the server steps; the two can differ,
  docs/decisions/threads-and-the-event-loop.md: compare both);
- served: a `mixserve serve` subprocess on 127.0.0.1 with the step trace on, N concurrent streaming
  /v1/completions from this process, and /health polled every 20 ms from a thread meanwhile.
From each step trace: the steps that decode all N sequences and prefill nothing; their duration (the step's
own work) and their period (start to next start: the step plus everything between two steps, which is what a
stream sees). Prints both side by side with the ratios against the issue's criterion (a decode batch costs at
most 1.15x through the server what it costs offline) and /health latency percentiles against 50 ms p99. Engine
flags (--threads, --dtype, ...) go to both runs. `make bench-serve`. Loopback only; the client and the poller
share the machine's cores with the server, so the served figures are an upper bound (both are lean for that
reason: mixserve/bench/lean_http.py, http.client; docs/decisions/sharing-cores-with-the-server.md).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import httpx  # noqa: E402

from bench.argv import without, write_report  # noqa: E402
from mixserve.bench.client import stream_one  # noqa: E402
from mixserve.bench.report import RequestResult  # noqa: E402
from mixserve.bench.server import ServerProcess, free_port  # noqa: E402
from mixserve.bench.workload import RequestSpec  # noqa: E402
from mixserve.config import add_engine_flags  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_STEP_RATIO, MAX_HEALTH_P99_S = 1.15, 0.050
OWN_FLAGS = {"--out": 1, "--rounds": 1, "--health-interval": 1, "--timeout": 1, "--offline-child": 1}
WORKLOAD_FLAGS = {"--num-requests": 1, "--prompt-len": 1, "--output-tokens": 1, "--offline-thread": 0}


def prompts(n: int, length: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def offline_child(args: argparse.Namespace) -> int:
    """The offline run (in its own process: the engine binds the threads of whoever loads it)."""
    from mixserve import SamplingParams
    from mixserve.config import config_from_args
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    cfg = config_from_args(args).engine
    llm = LLM.from_engine(LLMEngine.from_config(cfg))  # cfg.step_trace is our trace file
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)  # warm-up, as the served run has one; its steps are of one sequence
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    batch = prompts(args.num_requests, args.prompt_len, llm.engine.vocab_size)
    if args.offline_thread:  # step from a fresh thread, as the server's step thread does
        worker = threading.Thread(target=llm.generate, args=(batch, params))
        worker.start()
        worker.join()
    else:
        llm.generate(batch, params)  # as users call it: on the thread that loaded the model
    llm.engine.close()
    return 0


def decode_steps(trace: Path, n: int) -> dict[str, Any]:
    """Duration and period (start to next start) of the steps that decode n sequences and prefill none."""
    steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    full = [i for i, s in enumerate(steps) if s["decode_tokens"] == n and s["prefill_tokens"] == 0]
    durations = [steps[i]["duration_s"] for i in full]
    periods = [steps[i + 1]["time"] - steps[i]["time"] for i in full if i + 1 < len(steps)
               and steps[i + 1]["decode_tokens"] == n and steps[i + 1]["prefill_tokens"] == 0]
    if not durations or not periods:
        raise RuntimeError(f"{trace}: no two consecutive decode steps of {n} sequences")
    return {"steps": len(durations), "duration_p50_s": statistics.median(durations),
            "duration_mean_s": statistics.fmean(durations), "period_p50_s": statistics.median(periods),
            "period_mean_s": statistics.fmean(periods)}


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"count": len(xs), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}


def poll_health(url: str, interval: float, stop: threading.Event, out: list[float]) -> None:
    """GET /health every `interval` seconds until stop; the latency of each (a failure counts as 10 s).
    The standard library's client on one kept-alive connection: httpx's CPU per GET, 50 a second, is
    taken from the server's cores (docs/decisions/sharing-cores-with-the-server.md)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10.0)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200
        except (OSError, http.client.HTTPException):
            conn.close()  # the next request connects again
            ok = False
        out.append(time.perf_counter() - start if ok else 10.0)
        stop.wait(interval)  # the pace of the poll, not a synchronisation
    conn.close()


async def stream_all(url: str, specs: list[RequestSpec]) -> list[RequestResult]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
    warm = RequestSpec(0, 0.0, [5, 6, 7, 8], 4, 4)
    await stream_one(f"{url}/v1/completions", model, warm, time.perf_counter())
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(stream_one(f"{url}/v1/completions", model, s, t0) for s in specs)))


def served(args: argparse.Namespace, eng: list[str], trace: Path, log: Path) -> dict[str, Any]:
    """N concurrent streams through a `mixserve serve` subprocess, /health polled meanwhile."""
    port = free_port()
    argv = [sys.executable, "-m", "mixserve", "serve", "--port", str(port), "--step-trace", str(trace), *eng]
    specs = [RequestSpec(i, 0.0, p, len(p), args.output_tokens)
             for i, p in enumerate(prompts(args.num_requests, args.prompt_len))]
    with ServerProcess(argv, port, log, startup_timeout_s=args.timeout) as server:
        latencies: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=poll_health,
                                  args=(server.url, args.health_interval, stop, latencies))
        poller.start()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            results = asyncio.run(asyncio.wait_for(stream_all(server.url, specs), args.timeout))
        finally:
            stop.set()
            poller.join()
        # The client and the poller share the server's cores: what they burn is taken from its steps.
        client_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}; server log: {log}")
    tpots = [t for r in results if (t := r.tpot) is not None]
    return {"client_tpot_p50_s": statistics.median(tpots), "health_s": percentiles(latencies),
            "client_cpu_cores": client_cores}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_engine_flags(parser)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--health-interval", type=float, default=0.02, help="seconds between /health GETs")
    parser.add_argument("--rounds", type=int, default=1, help="offline and served alternated R times; "
                        "each side's best round is reported")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    parser.add_argument("--out", default=str(HERE / "results" / "serve_overhead.json"))
    parser.add_argument("--offline-thread", action="store_true",
                        help="offline, step from a fresh thread (as the server does), not the loading one")
    parser.add_argument("--offline-child", metavar="TRACE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_child:
        args.engine_step_trace = args.offline_child
        return offline_child(args)
    eng = without(argv, OWN_FLAGS)  # the offline child parses the workload flags too, the server not
    server_eng = without(eng, WORKLOAD_FLAGS)
    rounds: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []
    for r in range(1, args.rounds + 1):  # alternated, so a noisy neighbour's burst hits both sides alike
        with tempfile.TemporaryDirectory() as tmp:
            off_trace, srv_trace, log = Path(tmp, "offline.jsonl"), Path(tmp, "served.jsonl"), Path(tmp, "l")
            print(f"[{r}/{args.rounds}] offline: {args.num_requests} x ({args.prompt_len} in, "
                  f"{args.output_tokens} out) ...", flush=True)
            subprocess.run([sys.executable, __file__, *eng, "--offline-child", str(off_trace)], check=True,
                           timeout=args.timeout, stdin=subprocess.DEVNULL)
            offline = decode_steps(off_trace, args.num_requests)
            print(f"[{r}/{args.rounds}] served: mixserve serve on 127.0.0.1, the same requests streamed ...",
                  flush=True)
            client = served(args, server_eng, srv_trace, log)
            rounds.append((offline, decode_steps(srv_trace, args.num_requests), client))
        print(f"[{r}/{args.rounds}] decode step period p50: offline {1e3 * offline['period_p50_s']:.1f} ms, "
              f"served {1e3 * rounds[-1][1]['period_p50_s']:.1f} ms", flush=True)
    # the best round of each side: noise on a shared machine only ever adds time
    offline = min((o for o, _, _ in rounds), key=lambda o: o["period_p50_s"])
    server, client = min(((s, c) for _, s, c in rounds), key=lambda sc: sc[0]["period_p50_s"])
    dur = server["duration_p50_s"] / offline["duration_p50_s"]
    per = server["period_p50_s"] / offline["period_p50_s"]
    h = client["health_s"]
    ok = lambda good: "met" if good else "MISSED"  # noqa: E731
    print(f"decode step of {args.num_requests} sequences   {'offline':>9} {'served':>9} {'ratio':>6}")
    print(f"  duration p50 (the step's work)   {1e3 * offline['duration_p50_s']:>7.1f}ms "
          f"{1e3 * server['duration_p50_s']:>7.1f}ms {dur:>6.2f}")
    print(f"  period p50 (start to next start) {1e3 * offline['period_p50_s']:>7.1f}ms "
          f"{1e3 * server['period_p50_s']:>7.1f}ms {per:>6.2f}  <= {MAX_STEP_RATIO}x: "
          f"{ok(per <= MAX_STEP_RATIO)}")
    print(f"  client TPOT p50 through the server: {1e3 * client['client_tpot_p50_s']:.1f} ms; the client and "
          f"the /health poller (this process, on the server's cores) used {client['client_cpu_cores']:.0%} "
          f"of a core meanwhile")
    print(f"/health during the run ({h['count']} GETs): p50 {1e3 * h['p50']:.1f} ms, "
          f"p90 {1e3 * h['p90']:.1f} ms, "
          f"p99 {1e3 * h['p99']:.1f} ms, max {1e3 * h['max']:.1f} ms  p99 <= 50 ms: "
          f"{ok(h['p99'] <= MAX_HEALTH_P99_S)}")
    report = {"settings": {**vars(args), "load_average": os.getloadavg()}, "offline": offline,
              "rounds": [{"offline": o, "served": {**sv, **c}} for o, sv, c in rounds],
              "served": {**server, **client}, "ratio_duration": dur, "ratio_period": per,
              "criteria": {"max_step_ratio": MAX_STEP_RATIO, "max_health_p99_s": MAX_HEALTH_P99_S}}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
