"""Decode-sized linears with the weights coming from memory: the panels (mixserve/model/cpu/few_row_linear.py)
against the GEMM the CPU ops use without them (float32: MKL on Intel's AVX-512 CPUs, else oneDNN; bf16:
oneDNN; torch.mv at one row).

Not a test. Run: .venv/bin/python bench/few_row_gemm.py [--dtype bfloat16] [--repeats 5]
30 layers of the default model's four linear shapes, random weights, cycled so that each call reads its weight
from memory as a forward does; ms per 120 calls, best of the repeats, the two alternated. Rows above the
weight's `few.max_rows` (float32 128, 32 beside MKL; bf16 64 on AMX tiles, 256 without AMX) run the same GEMM
in both columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import cpu_flags  # noqa: E402

from mixserve.engine.threads import bind_threads, set_threads  # noqa: E402
from mixserve.model import ops  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o_proj, gate_up, down (n, k)
LAYERS, ROWS = 30, (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bind_threads(set_threads(0))
    dtype = getattr(torch, args.dtype)
    cpu = ops.cpu_ops(dtype)
    print("cpu:", cpu_flags(), "ops:", cpu.name)
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    panels = [[cpu.pack(w) for w in layer] for layer in weights]
    if panels[0][0].few is None:
        print("no panels on this CPU (needs AVX-512; bf16 also AVX512-BF16): nothing to compare")
        return
    plain = [[dataclasses.replace(p, few=None) for p in layer] for layer in panels]
    print(f"{'rows':>5} {'without ms':>11} {'panels ms':>10} {'ratio':>6}")
    for m in ROWS:
        xs = [torch.randn(m, k, generator=g).to(dtype) for _, k in SHAPES]
        best = {"without": float("inf"), "panels": float("inf")}
        for _ in range(args.repeats):
            for name, packed in (("without", plain), ("panels", panels)):
                t0 = time.perf_counter()
                for layer in packed:
                    for x, w in zip(xs, layer, strict=True):
                        cpu.linear(x, w, None)
                best[name] = min(best[name], time.perf_counter() - t0)
        a, b = 1e3 * best["without"], 1e3 * best["panels"]
        print(f"{m:>5} {a:>11.2f} {b:>10.2f} {a / b:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
