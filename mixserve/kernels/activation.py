"""SwiGLU's silu(gate) * up as one Triton launch over the fused gate/up projection's output.

Eager PyTorch spends a chunk, a SiLU and a multiply (2-3 kernels, and a (T, I) temporary) on it. Here
each program reads a slice of gate and the matching slice of up from the (T, 2I) row and writes (T, I).

Numerics follow `F.silu(gate) * up` in the model dtype: SiLU in float32 rounded to the dtype, then the
product rounded again (in float32 the casts are no-ops).

Imports triton at module level: import this only after `mixserve.kernels.use_triton` said yes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_BLOCK = 1024  # columns per program; wider rows take more programs along grid axis 1


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, gate_up_row_stride, out_row_stride, n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * gate_up_row_stride
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) [gate | up] -> (T, I) silu(gate) * up, one launch; a new tensor in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be (T, 2I) with contiguous rows, got shape {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    tokens, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    if tokens > 0 and n_cols > 0:
        grid = (tokens, triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n_cols,
                                   BLOCK=block, num_warps=4)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch silu(gate) * up, as the unfused model computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
