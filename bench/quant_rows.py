"""Where the quantized linears' two paths cross, and how far each is from the float32 one, per row count.

Not a test. Run: .venv/bin/python bench/quant_rows.py [--qtype 3] [--repeats 5] [--rows 1,8,16,32,64,256]
30 layers of the default model's four linear shapes as random blocks of one GGUF format (default Q4_1, the
default file's), cycled so each call reads its weight from memory as a forward does. Per row count, ms per
120 calls (best of the repeats, the paths alternated): `block` the few-row entry (decode steps up to
quant_linear.FEW_ROWS: the block kernel, from csrc/quant_linear.cpp's PANEL_ROWS the panels), `panels` a
column panel at a time decoded into cache and multiplied there (prefill chunks), `bf16` the same panels
rounded to bf16 pairs against bf16 inputs (AVX512-BF16 builds only), `none` the float32 path on the
dequantized weight (panels up to their max rows, then torch's GEMM), `none-bf16` the same in bf16 (dtype
bfloat16 with quantization none: the yardstick of `bf16`).
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

from mixserve.engine.threads import bind_threads, set_threads  # noqa: E402
from mixserve.model import ops  # noqa: E402
from mixserve.model.cpu import build  # noqa: E402
from mixserve.model.cpu import quant_linear as ql  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o_proj, gate_up, down (n, k)
LAYERS = 30
# time ratios printed: a yardstick's over a quantized path's (> 1: the quantized path is faster)
RATIOS = (("none", "block"), ("none", "panels"), ("none", "bf16"), ("none-bf16", "bf16"))
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> ql.QuantWeight:
    """Random blocks whose fp16 fields are small finite scales (as tests/model/test_quant_linear.py)."""
    _, elems, nbytes = ql.FORMATS[qtype]
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, size=(n, k // elems)).astype(np.float16)
        raw[:, :, off : off + 2] = halves.view(np.uint8).reshape(n, k // elems, 2)
    return ql.from_blocks(qtype, torch.from_numpy(raw.reshape(n, -1)), k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtype", type=int, default=3, choices=sorted(set(ql.FORMATS) - {ql.INT8_ROW}))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,8,16,24,32,48,64,128,256")
    args = ap.parse_args()
    bind_threads(set_threads(0))
    cpu = ops.cpu_ops(torch.float32)
    print("cpu:", cpu_flags(), "| kernels:", build.describe(), "| format:", ql.FORMATS[args.qtype][0])
    rng = np.random.default_rng(0)
    quant = [[random_weight(args.qtype, n, k, rng) for n, k in SHAPES] for _ in range(LAYERS)]
    dense = [[cpu.pack(ql.dequantize(w)) for w in layer] for layer in quant]
    paths = {"block": lambda x, w, _d: ql._few_rows(x, w, None),
             "panels": lambda x, w, _d: ql._panels(x, w, None),
             "none": lambda x, _w, d: cpu.linear(x, d, None)}
    if ql.bf16_panels():
        cpu16 = ops.cpu_ops(torch.bfloat16)
        dense16 = {id(w): cpu16.pack(ql.dequantize(w).bfloat16()) for layer in quant for w in layer}
        paths["bf16"] = bf16_panels
        paths["none-bf16"] = lambda x, w, _d: cpu16.linear(x.bfloat16(), dense16[id(w)], None)
    ratios = [(a, b) for a, b in RATIOS if a in paths and b in paths]
    print(f"{'rows':>5} " + " ".join(f"{name + ' ms':>10}" for name in paths) + " "
          + " ".join(f"{a + '/' + b:>15}" for a, b in ratios))
    g = torch.Generator().manual_seed(0)
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        best = dict.fromkeys(paths, float("inf"))
        for rep in range(args.repeats):
            order = list(paths) if rep % 2 == 0 else list(paths)[::-1]  # the machine's drift falls on all
            for name in order:
                fn = paths[name]
                t0 = time.perf_counter()
                for qs, ds in zip(quant, dense, strict=True):
                    for x, w, d in zip(xs, qs, ds, strict=True):
                        fn(x, w, d)
                best[name] = min(best[name], time.perf_counter() - t0)
        ms = {name: 1e3 * t for name, t in best.items()}
        print(f"{m:>5} " + " ".join(f"{ms[name]:>10.2f}" for name in paths) + " "
              + " ".join(f"{ms[a] / ms[b]:>15.2f}" for a, b in ratios), flush=True)



def bf16_panels(x: torch.Tensor, w: ql.QuantWeight, _dense: object) -> torch.Tensor:
    """The bf16 panels on x rounded to bf16 (the rounding counted: a float32 model's linear would pay it)."""
    return ql._bf16_panels(x.to(torch.bfloat16), w, None)


if __name__ == "__main__":
    main()
