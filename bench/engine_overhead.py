#!/usr/bin/env python3
"""The engine's own cost per step: LLM.generate over a runner that returns logits at once.

On a GPU a decode step of a small model takes a millisecond or two, and the host's work between steps
(schedule, plan, sample, detokenize, stop checks) runs serially with it; this measures that host work
alone. The runner keeps the default model's tokenizer and vocabulary but does no forward, and the
logits are prepared so the greedy pick is cheap: what is left is the engine.

    .venv/bin/python bench/engine_overhead.py                 # 64 x (512 in, 128 out)
    .venv/bin/python bench/engine_overhead.py --profile       # plus the top of a cProfile

In the same run it times one real fp32 decode step of the same 64 sequences on this CPU (the default
model's forward at the workload's middle context) and prints the engine's share of it: the CPU fast path
issue's target is at most 10%.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

import torch

from mixserve.config import EngineConfig
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM
from mixserve.engine.sampling_params import SamplingParams
from mixserve.runner.model_runner import ModelRunner


class InstantRunner:
    """The runner interface the engine uses, without a model: forward returns fixed logits."""

    def __init__(self, real: ModelRunner, num_blocks: int, block_size: int = 16) -> None:
        self.tokenizer, self.config = real.tokenizer, real.config
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_model_len = real.max_model_len
        self.device = torch.device("cpu")
        # One-hot rows over the first 2,048 ids only: the sampler's argmax over a full vocabulary is device
        # work on a GPU (and milliseconds on a CPU), not the engine's; ids 1000+ are ordinary tokens.
        self.logits = torch.zeros(512, 2048)
        self.logits[torch.arange(512), 1000 + torch.arange(512)] = 1.0

    def forward(self, batch: Any) -> torch.Tensor:
        return self.logits[: len(batch.seqs)]


def real_decode_step_ms(num_seqs: int, context: int, repeats: int = 5) -> float:
    """Best-of-`repeats` time of one fp32 forward of `num_seqs` decodes at `context` on the default model."""
    from mixserve.engine.threads import bind_threads, set_threads

    bind_threads(set_threads(0))
    per_seq = -(-context // 16)
    runner = ModelRunner.from_pretrained(None, num_blocks=num_seqs * per_seq, block_size=16, device="cpu",
                                         dtype="float32")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    batch = ForwardBatch([ForwardSeq(f"r{i}", [1000 + i], context - 1, t) for i, t in enumerate(tables)])
    runner.forward(batch)  # warm-up: first-touch of the cache, oneDNN primitives
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-real-step", action="store_true", help="skip timing the real CPU decode step")
    args = ap.parse_args()

    context = args.prompt_len + args.output_len // 2
    # First, while this thread still runs torch's default threads: the instant engine below sets one thread
    # (threads=1), and a pool re-sized and re-bound after that runs this step far slower
    # (docs/decisions/threads-and-the-event-loop.md).
    step_ms = None if args.no_real_step else real_decode_step_ms(args.num_requests, context)
    real = ModelRunner.from_pretrained(None, num_blocks=1, block_size=16, device="cpu")
    per_request = -(-(args.prompt_len + args.output_len) // 16)
    runner = InstantRunner(real, num_blocks=args.num_requests * per_request + 8)
    engine = LLMEngine(runner, EngineConfig(max_num_seqs=args.num_requests, max_batch_tokens=8192,
                                            prefill_chunk=512, threads=1))
    llm = LLM.from_engine(engine)
    prompts = [list(range(100 + i, 100 + i + args.prompt_len)) for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up

    steps_before = engine._num_steps
    profile = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profile:
        profile.disable()
    elapsed = time.perf_counter() - t0
    steps = engine._num_steps - steps_before
    tokens = sum(len(o.token_ids) for o in outputs)
    shape = f"{args.num_requests} x ({args.prompt_len} in, {args.output_len} out)"
    print(f"{shape}: {steps} steps, {tokens} tokens in {elapsed:.3f} s: "
          f"{elapsed / steps * 1e3:.2f} ms of engine per step")
    if step_ms is not None:
        share = elapsed / steps * 1e3 / step_ms
        print(f"real fp32 decode step of {args.num_requests} sequences at context "
              f"{context}: {step_ms:.1f} ms; engine share {100 * share:.1f}% "
              f"(target <= 10%: {'met' if share <= 0.10 else 'missed'})")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
