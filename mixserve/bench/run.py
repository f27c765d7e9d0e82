"""One bench run: warm up, scrape /metrics, drive the load, scrape again, and build the report."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mixserve.bench import promcheck
from mixserve.bench.client import LoadRun, base_url, run_load
from mixserve.bench.report import STALL_THRESHOLD_S, RequestResult, build_report
from mixserve.bench.workload import RequestSpec, random_tokens


@dataclass(frozen=True)
class RunOptions:
    """How to drive the server, as opposed to what to send (the workload)."""

    model: str | None = None
    max_concurrency: int | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    stall_threshold: float = STALL_THRESHOLD_S
    warmup: int = 2  # short requests sent one by one before measuring, so first-call costs stay out
    vocab_size: int = 32000
    timeout_s: float = 600.0
    logprobs: int | None = None  # ask for logprobs so a server sends a chunk for every token
    max_duration_s: float | None = None  # cancel what is unfinished this long after the start
    progress: bool = True


def warmup_specs(n: int, vocab_size: int) -> list[RequestSpec]:
    rng = random.Random(12345)
    return [RequestSpec(i, 0.0, random_tokens(16, vocab_size, rng), 16, 4) for i in range(n)]


def request_records(results: Sequence[RequestResult]) -> list[dict]:
    """Per-request raw timings for the JSON report, so pictures can be redrawn from it alone."""
    return [
        {"index": r.index, "kind": r.kind, "ok": r.ok, "prompt_tokens": r.prompt_tokens,
         "completion_tokens": r.completion_tokens, "start": round(r.start, 6), "end": round(r.end, 6),
         "token_times": [round(t, 6) for t in r.token_times]}
        for r in results
    ]


def results_from_records(records: Sequence[dict]) -> list[RequestResult]:
    """The inverse of request_records (the error text is not kept)."""
    return [
        RequestResult(d["index"], d["kind"], d.get("prompt_tokens") or 0, d.get("completion_tokens") or 0,
                      ok=d["ok"], start=d["start"], end=d["end"], token_times=list(d["token_times"]),
                      prompt_tokens=d.get("prompt_tokens"), completion_tokens=d.get("completion_tokens"))
        for d in records
    ]


def run_bench(url: str, specs: Sequence[RequestSpec], opts: RunOptions, settings: dict | None = None) -> dict:
    """Drive `specs` against the server at url and return the full JSON report (with the cross-check)."""
    root = base_url(url)
    if opts.warmup:
        warm = asyncio.run(run_load(root, warmup_specs(opts.warmup, opts.vocab_size), model=opts.model,
                                    max_concurrency=1, timeout_s=opts.timeout_s, progress=False))
        failed = [r.error for r in warm.results if not r.ok]
        if len(failed) == len(warm.results):
            raise RuntimeError(f"the server at {root} failed every warm-up request: {failed[0]}")
    before = promcheck.scrape(root)
    run: LoadRun = asyncio.run(run_load(root, specs, model=opts.model, max_concurrency=opts.max_concurrency,
                                        timeout_s=opts.timeout_s, logprobs=opts.logprobs,
                                        max_duration_s=opts.max_duration_s, progress=opts.progress))
    after = promcheck.scrape(root)
    settings = dict(settings or {}, url=root, model=run.model, max_concurrency=opts.max_concurrency,
                    logprobs=opts.logprobs, max_duration_s=opts.max_duration_s,
                    warmup_requests=opts.warmup, t0_monotonic=run.t0_monotonic, t0_wall=run.t0_wall)
    report = build_report(run.results, run.duration, settings=settings, slo_ttft=opts.slo_ttft,
                          slo_tpot=opts.slo_tpot, stall_threshold=opts.stall_threshold)
    # The server observes every request that got a token, cancelled ones too: compare like with like.
    seen = [r for r in run.results if r.token_times]
    ttfts = [r.ttft for r in seen]
    gaps = [g for r in seen for g in r.gaps]
    report["server_check"] = promcheck.compare(before, after, sum(ttfts) / len(ttfts) if ttfts else None,
                                               sum(gaps) / len(gaps) if gaps else None)
    chunks = sum(len(r.token_times) for r in run.results if r.ok)
    tokens = report["total_output_tokens"]
    # below 1 when the server merged tokens into one chunk (text held back): ITL then spans several tokens
    report["chunks_per_token"] = chunks / tokens if tokens else None
    report["requests"] = request_records(run.results)
    return report
