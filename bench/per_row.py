#!/usr/bin/env python3
"""Where a decode step's host time goes, per row: the real default model decoding N sequences offline,
each phase of `LLMEngine.step` timed (schedule+plan, forward, sample, scheduler.update, postprocess =
detokenize, stop checks, updates), and the same updates formatted as the server's SSE chunks.

The step-cost model has a per-sequence term (docs/decisions/step-cost-per-sequence.md); this says which
part of a step grows with its rows, measured, not guessed. Greedy by default (as the bench client
sends); `--temperature 0.7` samples, `--seed` seeds each request, `--penalty` adds a presence penalty.

    .venv/bin/python bench/per_row.py --num-requests 40 --steps 24
    .venv/bin/python bench/per_row.py --num-requests 40 --profile   # plus the top of a cProfile of the
                                                                    # host phases (forward excluded)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mixserve.config import EngineConfig  # noqa: E402
from mixserve.engine import LLMEngine  # noqa: E402
from mixserve.engine.sampling_params import SamplingParams  # noqa: E402
from mixserve.server.openai_format import Formatter, sse  # noqa: E402


def timed(times: dict[str, list[float]], name: str, fn: Any, profile: cProfile.Profile | None) -> Any:
    """fn wrapped to add its wall time to times[name] (and to run under `profile`, unless forward)."""
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return fn(*a, **k)
        finally:
            if profile is not None:
                profile.disable()
            times[name].append(time.perf_counter() - t0)
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed (after the prefill)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", action="store_true", help="a seed per request")
    ap.add_argument("--penalty", action="store_true", help="presence_penalty 0.5 on every request")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    engine = LLMEngine.from_config(EngineConfig(max_num_seqs=args.num_requests, max_batch_tokens=8192,
                                                prefill_chunk=0, dtype=args.dtype))
    rng = random.Random(0)
    vocab = engine.vocab_size
    for i in range(args.num_requests):
        params = SamplingParams(max_tokens=args.steps + 8, temperature=args.temperature, ignore_eos=True,
                                seed=i if args.seed else None,
                                presence_penalty=0.5 if args.penalty else 0.0)
        engine.add_request(f"r{i}", [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)], params)
    engine.step()  # the prefill of every prompt (not timed)
    engine.step()  # one decode step: warm-up
    times: dict[str, list[float]] = defaultdict(list)
    profile = cProfile.Profile() if args.profile else None
    runner, sched = engine.runner, engine.scheduler
    runner.forward = timed(times, "forward", runner.forward, None)
    sched.update = timed(times, "scheduler.update", sched.update, profile)
    engine._sample = timed(times, "sample", engine._sample, profile)
    engine._postprocess = timed(times, "postprocess", engine._postprocess, profile)
    fmts = [Formatter(f"cmpl-{i}", "m", False, engine.tokenizer) for i in range(args.num_requests)]
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        updates = engine.step()
        if profile is not None:
            profile.disable()
        times["step"].append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        for u in updates:  # what the event loop does per update: one SSE chunk (as generation.py)
            fmt = fmts[int(u.request_id[1:])]
            if hasattr(fmt, "delta_event"):
                fmt.delta_event(u.new_text, None, None)
            else:  # a tree from before delta_event
                sse(fmt.delta_chunk(u.new_text, None, None))
        times["sse format"].append(time.perf_counter() - t1)
        assert len(updates) == args.num_requests
    med = {k: statistics.median(v) for k, v in times.items()}
    rest = med["step"] - sum(med[k] for k in ("forward", "sample", "scheduler.update", "postprocess"))
    n = args.num_requests
    print(f"{n} decodes, {args.steps} steps, temperature {args.temperature}, seed {args.seed}, "
          f"penalty {args.penalty}: median per step")
    for k in ("step", "forward", "sample", "scheduler.update", "postprocess", "sse format"):
        print(f"  {k:<18} {1e3 * med[k]:8.2f} ms   {1e6 * med[k] / n:8.1f} us/row")
    print(f"  {'rest of step':<18} {1e3 * rest:8.2f} ms   {1e6 * rest / n:8.1f} us/row  "
          "(schedule, plan, trace)")
    host = med["step"] - med["forward"]
    print(f"  host (step - forward) {1e3 * host:.2f} ms = {1e6 * host / n:.1f} us/row")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
