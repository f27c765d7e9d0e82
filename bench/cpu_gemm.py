"""The CPU linear layers of the default model's shapes: F.linear against the prepacked oneDNN and MKL paths.

Not a test. Run: .venv/bin/python bench/cpu_gemm.py [--dtype float32|bfloat16] [--threads 0] [--rounds 40]
Prints ms per call (the minimum over interleaved single calls: robust on a shared, noisy machine) for
  F        F.linear on the plain weight (MKL sgemm in fp32, oneDNN in bf16)
  dnn      torch.ops.mkldnn._linear_pointwise on a weight reordered once with batch_size=None (what
           mixserve/model/ops.py uses: one layout for every row count)
  dnn@M    the same with the weight reordered for exactly M rows (an upper bound: we pack once)
  mkl@M    torch.ops.mkl._mkl_linear packed for exactly M rows (inductor's fp32 path; other row counts fall
           back to the plain weight)
  mv       torch.mv (one row only): aten's GEMV
--copies 30 cycles through 30 copies of each weight, so they come from memory as in a forward.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 heads x 64 (3 KV heads), intermediate 1536, vocab 49152 (tied LM head).
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def best_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for f in fns.values():
        f()
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {k: 1000 * v for k, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    ap.add_argument("--copies", type=int, default=1,
                    help="cycle through this many copies of each weight: 30 (the model's layers) times the "
                         "weights coming from memory, as in a forward, rather than hot in the cache")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dnn, mkl = torch.ops.mkldnn, torch.ops.mkl
    print(f"dtype {dtype}  threads {torch.get_num_threads()}  cpu {torch.backends.cpu.get_cpu_capability()}")
    for name in args.shapes:
        n, k = SHAPES[name]
        # The LM head alone outgrows any cache: two copies are enough (and 30 would take gigabytes).
        copies = min(args.copies, 2) if n * k > 1 << 23 else args.copies
        ws = [(torch.randn(n, k) / k**0.5).to(dtype) for _ in range(copies)]
        packed = [dnn._reorder_linear_weight(w, None) for w in ws]
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            exact = [dnn._reorder_linear_weight(w, m) for w in ws]

            def cycle(call: Callable[[int], object], c: int = len(ws)) -> Callable[[], object]:
                turn = iter(range(1 << 62))
                return lambda: call(next(turn) % c)

            fns: dict[str, Callable[[], object]] = {
                "F": cycle(lambda i, x=x, ws=ws: F.linear(x, ws[i])),
                "dnn": cycle(lambda i, x=x, p=packed: dnn._linear_pointwise(x, p[i], None, "none", [], "")),
                "dnn@M": cycle(lambda i, x=x, p=exact: dnn._linear_pointwise(x, p[i], None, "none", [], "")),
            }
            if m == 1:
                fns["mv"] = cycle(lambda i, x=x, ws=ws: torch.mv(ws[i], x[0]))
            if dtype == torch.float32:
                mp = [mkl._mkl_reorder_linear_weight(w, m) for w in ws]
                fns["mkl@M"] = cycle(lambda i, x=x, p=mp, ws=ws, m=m:
                                     mkl._mkl_linear(x, p[i], ws[i], None, m))
            flops = 2 * m * n * k
            rounds = max(5, min(args.rounds, int(args.rounds * 3e8 / flops)))
            ms = best_ms(fns, rounds)
            cells = "  ".join(f"{key}={v:.3f}" for key, v in ms.items())
            gflops = flops / (min(ms.values()) * 1e6)
            print(f"{name:8} {m:4}  {cells}   best {min(ms, key=ms.__getitem__)} {gflops:.0f} GFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
