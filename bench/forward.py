"""tau(tokens): the time of one forward of T tokens on the default model, ours next to HF transformers'.

Not a test. Run: .venv/bin/python bench/forward.py [--max-tokens 2048] [--repeats 3] [--threads 0]
[--dtype bfloat16] [--no-hf] [--torch-ops].
Each T is one prompt of T tokens prefilled whole from position 0 (ours: one ForwardBatch; HF: one
forward with logits_to_keep=1, so both compute the LM head on the last token only). Median of repeats,
the contenders timed in turns. --torch-ops adds our runner on the plain torch ops (F.linear on unpacked
weights: the CPU path before the prepacked oneDNN linears), side by side in this process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.loader import default_model_path
from mixserve.model.ops import torch_ops
from mixserve.runner.model_runner import ModelRunner


def medians_ms(fns: dict[str, Callable[[], object]], repeats: int,
               stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Median (or `stat`) ms per contender, timed in turns (one call each per round): on a shared, noisy
    machine the load then falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up: first-touch allocations, oneDNN primitive creation
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * stat(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-hf", action="store_true", help="time ours only")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16, ours and HF's alike")
    ap.add_argument("--torch-ops", action="store_true",
                    help="also time a second runner on the plain torch ops (F.linear, no prepacking)")
    ap.add_argument("--min", action="store_true",
                    help="report the fastest repeat, not the median (on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    block_size = 16
    num_blocks = args.max_tokens // block_size + 1
    runner = ModelRunner.from_pretrained(None, num_blocks=num_blocks, block_size=block_size, device="cpu",
                                         dtype=args.dtype)
    base = None
    if args.torch_ops:
        base = ModelRunner.from_pretrained(None, num_blocks=num_blocks, block_size=block_size, device="cpu",
                                           dtype=args.dtype)
        base.model.prepare(torch_ops())
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=runner.dtype)
        hf.eval()

    vocab = runner.config.vocab_size
    table = list(range(num_blocks))
    print(f"model {runner.model_name}  dtype {runner.dtype}  threads {torch.get_num_threads()}  "
          f"ops {runner.ops.name}  cpu {runner.cpu_features}  KV bytes per token {runner.kv_bytes_per_token}")
    print(f"{'T':>6} {'ours ms':>10} {'torch-ops':>10} {'t-ops/ours':>10} {'HF ms':>10} {'HF/ours':>8} "
          f"{'ours tok/s':>11}")
    t = 1
    while t <= args.max_tokens:
        ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t)).tolist()
        batch = ForwardBatch([ForwardSeq("bench", ids, 0, table)])
        reps = args.repeats if t < 512 else max(1, args.repeats - 1)
        fns: dict[str, Callable[[], object]] = {"ours": lambda batch=batch: runner.forward(batch)}
        if base is not None:
            fns["base"] = lambda batch=batch, base=base: base.forward(batch)
        if hf is not None:
            x = torch.tensor([ids])

            def hf_forward(x=x):
                with torch.inference_mode():
                    hf(x, use_cache=False, logits_to_keep=1)

            fns["hf"] = hf_forward
        ms = medians_ms(fns, reps, min if args.min else statistics.median)
        ours, b, theirs = ms["ours"], ms.get("base", float("nan")), ms.get("hf", float("nan"))
        print(f"{t:>6} {ours:>10.1f} {b:>10.1f} {b / ours:>10.2f} {theirs:>10.1f} {theirs / ours:>8.2f} "
              f"{1000 * t / ours:>11.0f}", flush=True)
        t *= 2


if __name__ == "__main__":
    main()
