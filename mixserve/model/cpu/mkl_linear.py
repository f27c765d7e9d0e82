"""float32 linears through MKL's packed GEMM (`cblas_sgemm_pack` once at load, `cblas_sgemm_compute` a call).

torch's CPU build carries MKL inside libtorch_cpu.so and exports its CBLAS; torch's own wrapper of the packed
GEMM (torch.ops.mkl._mkl_linear) takes the packed weight only at the exact row count it was packed for.
Called directly, one weight packed once serves every row count (checked at start-up, `broken`). Used only on
Intel's AVX-512 CPUs, where it beats oneDNN's; resident memory equals the plain weights'. Measurements:
docs/decisions/mkl-only-on-intel.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mixserve.model.cpu import few_row_linear

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_PACK_ROWS_HINT = 256  # the row count the packing is told; every other count computes on the same buffer
MKL_FEW_ROWS = 32  # the panels' rows where MKL takes the rest: from 48 rows MKL is as fast as the panels
_I, _P, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@dataclass(frozen=True)
class MklPacked:
    """A (n, k) weight packed by MKL for out = x @ weight.T, the plain weight for one-row GEMVs, and the
    weight's column panels for few rows where they were asked for (`few`, few_row_linear.py)."""

    plain: Tensor
    buffer: Tensor
    n: int
    k: int
    few: few_row_linear.PanelWeight | None = None


@functools.cache
def _cblas() -> ctypes.CDLL:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack_get_size.argtypes = [_I, _I, _I, _I]
    lib.cblas_sgemm_pack.argtypes = [_I, _I, _I, _I, _I, _I, _F, _P, _I, _P]
    lib.cblas_sgemm_pack.restype = None
    lib.cblas_sgemm_compute.argtypes = [_I, _I, _I, _I, _I, _I, _P, _I, _P, _I, _F, _P, _I]
    lib.cblas_sgemm_compute.restype = None
    return lib


def pack(w: Tensor, few_rows: bool = False) -> MklPacked:
    """MKL's packing of w; with `few_rows`, also the panels that take few rows (where they build)."""
    w = w.detach().contiguous()
    n, k = w.shape
    lib = _cblas()
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k)
    buffer = torch.empty(size // 4 + 16, dtype=torch.float32)
    # B = weight.T (k x n), handed over as the row-major (n x k) weight with transb
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0, w.data_ptr(), k,
                         buffer.data_ptr())
    few = few_row_linear.pack(w) if few_rows else None
    if few is not None:
        few = dataclasses.replace(few, max_rows=min(few.max_rows, MKL_FEW_ROWS))
    return MklPacked(w, buffer, n, k, few)


def linear(x: Tensor, w: MklPacked, bias: Tensor | None) -> Tensor:
    """x (m, k) float32 -> x @ w.T + bias: few rows through the panels where `w` has them; else one row is a
    GEMV on the plain weight (aten's mv beats MKL's GEMM there) and more rows MKL's packed GEMM."""
    m = x.shape[0]
    if w.few is not None and m <= w.few.max_rows:
        return few_row_linear.linear(x, w.few, bias)
    if m == 1:
        y = torch.mv(w.plain, x[0]) if bias is None else torch.addmv(bias, w.plain, x[0])
        return y.unsqueeze(0)
    if x.stride(1) != 1 or x.stride(0) < w.k:
        x = x.contiguous()
    out = torch.empty((m, w.n), dtype=torch.float32)
    _cblas().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, w.n, w.k, x.data_ptr(), x.stride(0),
                                 w.buffer.data_ptr(), w.k, 0.0, out.data_ptr(), w.n)
    return out if bias is None else out.add_(bias)


@functools.cache
def broken() -> str | None:
    """None when MKL's packed GEMM is found and one packed weight gives F.linear's result at every row count
    tried here (odd shapes included), else why not (one line)."""
    try:
        _cblas()
    except (OSError, AttributeError) as e:  # a torch without MKL (ARM builds), or one that hides CBLAS
        return f"MKL's packed GEMM is not exported by this torch: {e}"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(45, 37, generator=g)
    packed = pack(w)
    for m in (2, 5, 33, 300):
        x = torch.randn(m, 37, generator=g)
        if not torch.allclose(linear(x, packed, None), F.linear(x, w), rtol=1e-4, atol=1e-4):
            return f"MKL's packed GEMM gave a wrong result at {m} rows from one packing"
    return None


@functools.cache
def unavailable() -> str | None:
    """None when the float32 linears take MKL's packed GEMM here, else why not (one line): it must work
    (`broken`), and the CPU must be an Intel one with AVX-512: MKL keeps its fast kernels for Intel's CPUs
    and runs slower than oneDNN on AMD's (docs/decisions/mkl-only-on-intel.md)."""
    why = broken()
    if why is not None:
        return why
    from mixserve.model.ops import cpu_features

    cpu = cpu_features()
    if cpu.vendor != "GenuineIntel" or not cpu.capability.startswith("AVX512"):
        return f"MKL's packed GEMM is slower than oneDNN's on this CPU ({cpu.vendor or 'vendor unknown'}, " \
               f"{cpu.capability})"
    return None
