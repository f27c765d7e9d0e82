"""Linears of few rows (decode steps) as one C++ call on weights laid out once in column panels.

A decode step's GEMMs have 1..64 rows: there MKL's packed GEMM reads each weight from memory and then
computes, one after the other (~150 GFLOP/s and ~10 GB/s at 32 rows, where the machine has twice each), and
so does oneDNN's in bf16. csrc/few_row_linear.cpp streams the weight in order and prefetches the next panel
while it computes this one. Measured here (2-core Xeon, AVX-512, AVX512-BF16, AMX; 30 layers of the default
model's four weights cycled so each comes from memory, ms per 120 calls, best of 5, the two alternated:
bench/few_row_gemm.py [--dtype bfloat16]):
    float32, MKL (torch.mv at 1 row) -> panels:
        rows 1: 28.3 -> 26.1   4: 34.7 -> 27.5   8: 38.8 -> 31.5   16: 46.1 -> 36.2   32: 57.9 -> 47.6
        (48: 68.6, 64: 82.6 in MKL, as fast as panels there)
    bfloat16, oneDNN (torch.mv at 1 row) -> panels (vdpbf16ps):
        rows 1: 28.6 -> 15.5   2: 28.9 -> 16.1   4: 26.1 -> 18.5   8: 27.0 -> 21.8
        16: 26.2 -> 33.1 (vdpbf16ps does 32 products a cycle, float32's rate: compute-bound from here)
    bfloat16 with AMX: the same panels through tile products (csrc/few_row_amx.h), vdpbf16ps -> tiles
    (two kernel builds called alternately, 2026-12-02):
        rows 1: 12.2 -> 12.0   2: 13.6 -> 12.1   4: 15.0 -> 12.6   8: 20.2 -> 13.3
    and whole bf16 decode steps, oneDNN above 8 rows -> tiles (two runners alternated, the same logits):
        12 sequences 49.6 -> 34.1 ms, 16: 46.6 -> 33.0, 24: 76.6 -> 49.6, 32: 80.4 -> 56.5
    and from 33 rows in two passes of 32 (oneDNN -> tiles): 40 sequences 83.4 -> 77.2, 48: 87.9 -> 85.1,
        64: 101.8 -> 99.8 (logits as close to float32's: mean |difference| 0.129 against oneDNN's 0.137)
On an AVX2-only CPU (Zen 3, 2.45 GHz, 2026-12-02) the panels are 16 columns wide, and MKL there is slow at
few rows, so they pay more: MKL -> panels, float32, the same bench:
        rows 1: 58.2 -> 27.6   4: 112.4 -> 25.6   8: 127.5 -> 29.4   16: 161.5 -> 46.4   32: 152.2 -> 63.4
    and against oneDNN (which float32 takes there instead of MKL, mkl_linear.unavailable), 30 layers cycled:
        rows 8: 71.5 -> 33.5   32: 94.5 -> 68.6   64: 146.3 -> 106.6   96: 195.4 -> 185.5, a tie to 256
On an AVX-512 Zen 5 without AMX (2026-12-02; MKL is slow there too, so oneDNN takes the rest), oneDNN ->
panels, the same 30 layers cycled: float32 rows 8: 13.9 -> 12.6   32: 24.7 -> 18.9   128: 70.5 -> 66.8,
256: 129.0 -> 134.1; bf16 (oneDNN runs the same vdpbf16ps there) rows 8: 8.6 -> 7.0   32: 14.3 -> 11.2
128: 37.9 -> 34.3   256: 68.3 -> 64.2   512: 134.9 -> 133.0.
So the kernel says how many rows a weight takes (`max_rows`: float32 128 against oneDNN, capped at 32 where
MKL takes the rest (mkl_linear.py); bf16 64 with AMX and k a multiple of 32, 8 beside oneDNN's AMX GEMM
otherwise, 256 on a CPU without AMX); above it MKL / oneDNN keep every row count (prefill chunks).
The panels are a second copy of each linear weight (the default model: +0.54 GB resident in float32, +0.27
in bf16); the decision is the runner's, once, through `ops.cpu_ops`: panels exist only where the kernels
built with AVX-512 or AVX2 (elsewhere `panel_width()` is 0 and nothing is packed), bf16 ones only with
AVX512-BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mixserve.model.cpu.build import KernelBuildError, load_library
from mixserve.model.cpu.layer_ops import DTYPE_CODE


@dataclass(frozen=True)
class PanelWeight:
    """An (n, k) weight as column panels of `panel_width()` columns, k-major within a panel (bf16: pairs of k
    side by side, as vdpbf16ps reads them)."""

    panels: Tensor
    n: int
    k: int
    max_rows: int  # the kernel's mixserve_few_row_max_rows: the linears send 1..max_rows rows here


def panel_width() -> int:
    """The panel width the kernel was built with (64 AVX-512, 16 AVX2); 0 where it was not (neither, or no C++
    kernels)."""
    try:
        return int(load_library().mixserve_few_row_panel_width())
    except KernelBuildError:
        return 0


def pack(w: Tensor) -> PanelWeight | None:
    """The panel layout of a float32 or bfloat16 weight, or None where the kernel cannot take it (no panels;
    bf16 without AVX512-BF16 or with an odd k): the caller keeps MKL's or oneDNN's linear."""
    width, code = panel_width(), DTYPE_CODE.get(w.dtype)
    if width == 0 or code is None:
        return None
    w = w.detach().contiguous()
    n, k = w.shape
    panels = torch.empty(-(-n // width) * k * width, dtype=w.dtype)
    lib = load_library()
    if lib.mixserve_few_row_pack(code, w.data_ptr(), n, k, panels.data_ptr()) != 0:
        return None
    return PanelWeight(panels, n, k, int(lib.mixserve_few_row_max_rows(code, k)))


def linear(x: Tensor, w: PanelWeight, bias: Tensor | None) -> Tensor:
    """x (m, k) in the weight's dtype, rows contiguous (a row stride of at least k is fine) -> x @ w.T + bias
    (bf16: products and sums in float32, rounded once to bf16)."""
    if x.stride(1) != 1 or x.stride(0) < w.k:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, w.n), dtype=w.panels.dtype)
    bias = None if bias is None else bias.contiguous()  # held here while the kernel reads it
    rc = load_library().mixserve_few_row_linear(
        DTYPE_CODE[w.panels.dtype], x.data_ptr(), x.stride(0), m, w.panels.data_ptr(), w.n, w.k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), w.n, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the few-row linear kernel cannot take these inputs (code {rc})")
    return out
