"""Where a decode step's time goes on this CPU: per-op timers around the runner's layer ops and attention.

Not a test. Run: .venv/bin/python bench/decode_profile.py [--seqs 1,32] [--context 512] [--repeats 5]
The default model (or --model PATH) in float32 (or --dtype bfloat16), the decode batches
bench/forward.py checks (one token; 32 sequences at context 512). Each op of the model's forward (each
linear by its weight's shape, the norms, SiLU, RoPE, attention) is timed with perf_counter around the call;
ms per forward, median of the repeats, beside the forward's own time, so the untimed rest (embedding,
Python) shows too. The timers add two perf_counter calls an op, and need the layers' Python body: a model
whose decode steps the C++ layer stack runs (model/cpu/decode_layers.py) runs the body here instead.
Prints the CPU's flags and the kernel build it ran ($MIXSERVE_KERNEL_MARCH=haswell: the AVX2 code).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.engine.threads import bind_threads, set_threads
from mixserve.model.cpu import build
from mixserve.runner.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import cpu_flags  # noqa: E402


class OpTimers:
    """Seconds per op name, summed over the calls of one forward."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name(*args) if callable(name) else name
            self.seconds[key] += time.perf_counter() - t0
            return out

        return timed


def linear_name(x: torch.Tensor, w: object, bias: object) -> str:
    plain = getattr(w, "plain", w)  # ops.PackedWeight / mkl_linear.MklPacked keep the plain weight
    n = plain.shape[0] if hasattr(plain, "shape") else "?"  # a tensor or a quantized weight
    return f"linear {x.shape[0]}x{x.shape[1]}x{n}"


def instrument(runner: ModelRunner, timers: OpTimers) -> None:
    """Swap the model's ops and the runner's attention for timed ones (the packed weights stay)."""
    ops = runner.model.ops
    timed = dataclasses.replace(
        ops, linear=timers.wrap(linear_name, ops.linear), rms_norm=timers.wrap("rms_norm", ops.rms_norm),
        add_rms_norm=timers.wrap("add_rms_norm", ops.add_rms_norm),
        silu_and_mul=timers.wrap("silu_and_mul", ops.silu_and_mul), rotary=timers.wrap("rotary", ops.rotary))
    head = runner.model.head
    runner.model.ops = timed
    runner.model.head = head  # (forward picks the packed head when ops is the model's own: it now is)
    attn = runner.attention
    attn.forward = timers.wrap("attention", attn.forward)  # type: ignore[method-assign]


def decode_batch(seqs: int, context: int, block_size: int) -> ForwardBatch:
    per_seq = -(-context // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    return ForwardBatch([ForwardSeq(f"d{i}", [1000 + i], context - 1, t) for i, t in enumerate(tables)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=512, help="context of each sequence (1-sequence: 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", default=None, help="a folder or GGUF file (default: the default model)")
    ap.add_argument("--quantization", default="auto", help="auto | none | int8 ([engine] quantization)")
    args = ap.parse_args()
    bind_threads(set_threads(args.threads))
    sizes = [int(s) for s in args.seqs.split(",")]
    block_size = 16
    num_blocks = max(sizes) * -(-args.context // block_size) + 1
    runner = ModelRunner.from_pretrained(args.model, num_blocks=num_blocks, block_size=block_size,
                                         dtype=args.dtype, quantization=args.quantization)
    print(f"cpu: {cpu_flags()}  kernels: {build.describe()}  ops: {runner.ops.name}  threads "
          f"{torch.get_num_threads()}")
    timers = OpTimers()
    instrument(runner, timers)
    for seqs in sizes:
        context = 1 if seqs == 1 else args.context
        batch = decode_batch(seqs, context, block_size)
        runner.forward(batch)  # warm
        per_op: dict[str, list[float]] = defaultdict(list)
        totals = []
        for _ in range(args.repeats):
            timers.seconds.clear()
            t0 = time.perf_counter()
            runner.forward(batch)
            totals.append(time.perf_counter() - t0)
            for name, s in timers.seconds.items():
                per_op[name].append(s)
        total = 1e3 * statistics.median(totals)
        print(f"\n{seqs} sequences at context {context}: forward {total:.1f} ms (median of {args.repeats})")
        rows = sorted(((1e3 * statistics.median(v), k) for k, v in per_op.items()), reverse=True)
        for ms, name in rows:
            print(f"  {name:<28} {ms:8.2f} ms  {ms / total:6.1%}")
        print(f"  {'untimed rest':<28} {total - sum(ms for ms, _ in rows):8.2f} ms")


if __name__ == "__main__":
    main()
