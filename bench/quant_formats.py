"""Decode-step speed of each GGUF format's few-row kernel: ms and GB/s of weight read at one input row.

Not a test. Run: .venv/bin/python bench/quant_formats.py [--rows 1] [--repeats 15]
30 random weights of one 3072x1536 shape (k a multiple of 256, so the K-quants run) per format, cycled so each
call reads its weight from memory as a decode step does; best of the repeats, the formats in turn each repeat.
Prints the CPU's flags and the kernels' build.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import cpu_flags  # noqa: E402
from quant_rows import random_weight  # noqa: E402

from mixserve.engine.threads import bind_threads, set_threads  # noqa: E402
from mixserve.model.cpu import build  # noqa: E402
from mixserve.model.cpu import quant_linear as ql  # noqa: E402

N, K, LAYERS = 3072, 1536, 30
QTYPES = (2, 3, 6, 7, 8, 12, 13, 14)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K, then int8 per channel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    bind_threads(set_threads(0))
    print("cpu:", cpu_flags(), "| kernels:", build.describe())
    rng = np.random.default_rng(0)
    weights = {q: [random_weight(q, N, K, rng) for _ in range(LAYERS)] for q in QTYPES}
    weights[ql.INT8_ROW] = [ql.quantize_int8(torch.randn(N, K)) for _ in range(LAYERS)]  # quantization int8
    x = torch.randn(args.rows, K)
    best = dict.fromkeys(weights, float("inf"))
    for _ in range(args.repeats):
        for q, ws in weights.items():
            t0 = time.perf_counter()
            for w in ws:
                ql.linear(x, w, None)
            best[q] = min(best[q], time.perf_counter() - t0)
    print(f"{'format':>7} {'ms':>8} {'MB':>8} {'GB/s':>6}  ({LAYERS} x {N}x{K}, {args.rows} row(s))")
    for q, ws in weights.items():
        mb = sum(w.nbytes for w in ws) / 1e6
        print(f"{ql.FORMATS[q][0]:>7} {1e3 * best[q]:8.2f} {mb:8.1f} {mb / 1e3 / best[q]:6.1f}")


if __name__ == "__main__":
    main()
