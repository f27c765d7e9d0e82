"""Linears of few rows (decode steps) as one C++ call on weights laid out once in column panels.

A decode step's GEMMs have 1..64 rows: there MKL's and oneDNN's GEMMs read each weight from memory and then
compute, one after the other. csrc/few_row_linear.cpp streams the weight in order and prefetches the next
panel while it computes this one, so the memory stream and the FMAs overlap. The kernel says how many rows a
weight takes (`max_rows`: float32 128 against oneDNN, 32 where MKL takes the rest; bf16 64 on AMX tiles with
k a multiple of 32, 8 beside oneDNN's AMX GEMM otherwise, 256 through vdpbf16ps on a CPU without AMX); above
it MKL / oneDNN keep every row count (prefill chunks). The panels are a second copy of each linear weight
(the default model: +0.54 GB in float32). Panels exist only where the kernels were built with AVX-512 or
AVX2 with FMA (elsewhere `panel_width()` is 0), bf16 ones only with AVX512-BF16. Why each threshold, with the
measurements: docs/decisions/few-row-panels.md.
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
