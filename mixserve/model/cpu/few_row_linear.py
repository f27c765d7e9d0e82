"""float32 linears of few rows (decode steps) as one C++ call on weights laid out once in column panels.

A decode step's GEMMs have 1..32 rows: there MKL's packed GEMM reads each weight from memory and then
computes, one after the other (~150 GFLOP/s and ~10 GB/s at 32 rows, where the machine has twice each).
csrc/few_row_linear.cpp streams the weight in order and prefetches the next panel while it computes this one.
Measured here (2-core Xeon, AVX-512; 30 layers of the default model's four weights cycled so each comes from
memory, ms per 120 calls, MKL -> panels, /tmp A/B in one process, best of 5 each):
    rows 1: 22.2 -> 19.0 (torch.mv -> panels)   4: 27.3 -> 20.7   8: 30.4 -> 22.7   16: 36.5 -> 31.6
    rows 32: 54.0 -> 44.7   64: 66.5 -> 69.1 (MKL from here on)
MKL's packed GEMM keeps every row count above FEW_ROWS (prefill chunks: there it runs near the FMA peak).
The panels are a second copy of each linear weight (the default model in float32: +0.54 GB resident); the
decision is the runner's, once, through `ops.cpu_ops`: the panels exist only where the kernels built with
AVX-512 (elsewhere `panel_width()` is 0 and nothing is packed).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from mixserve.model.cpu.build import KernelBuildError, load_library

FEW_ROWS = 32  # up to this many rows through the panels (see the table above)


@dataclass(frozen=True)
class PanelWeight:
    """A float32 (n, k) weight as column panels of `panel_width()` columns, k-major within a panel."""

    panels: Tensor
    n: int
    k: int


@functools.cache
def panel_width() -> int:
    """The panel width the kernel was built with; 0 where it was not (no AVX-512, or no C++ kernels)."""
    try:
        return int(load_library().mixserve_few_row_panel_width())
    except KernelBuildError:
        return 0


def pack(w: Tensor) -> PanelWeight | None:
    """The panel layout of a float32 weight, or None where the kernel is missing (the caller keeps MKL's)."""
    width = panel_width()
    if width == 0 or w.dtype != torch.float32:
        return None
    w = w.detach().contiguous()
    n, k = w.shape
    panels = torch.empty(-(-n // width) * k * width, dtype=torch.float32)
    if load_library().mixserve_few_row_pack(0, w.data_ptr(), n, k, panels.data_ptr()) != 0:
        return None
    return PanelWeight(panels, n, k)


def linear(x: Tensor, w: PanelWeight, bias: Tensor | None) -> Tensor:
    """x (m, k) float32, rows contiguous (a row stride of at least k is fine) -> x @ w.T + bias."""
    if x.stride(1) != 1 or x.stride(0) < w.k:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, w.n), dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()  # held here while the kernel reads it
    rc = load_library().mixserve_few_row_linear(
        0, x.data_ptr(), x.stride(0), m, w.panels.data_ptr(), w.n, w.k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), w.n, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the few-row linear kernel cannot take these inputs (code {rc})")
    return out
