"""RMSNorm, and the residual add fused into it, as one Triton launch each.

In bf16, eager PyTorch spends ~8 kernels on one RMSNorm (float, pow, mean, add, rsqrt, mul, cast, mul) and
one more on the residual add before it. Here one program normalises one row (T rows of H <= 8192): it
reads x (and the residual) once, writes the normed row (and the new residual) once.

Numerics follow `mixserve.model.ops.rms_norm`, which follows Hugging Face: the residual add is rounded
to the model dtype; the row is normalised in float32, cast to the dtype, then multiplied by the weight and
rounded again (in float32 every cast is a no-op).

Imports triton at module level: import this only after `mixserve.kernels.use_triton` said yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixserve.kernels import NORM_MAX_HIDDEN as MAX_HIDDEN  # one program holds a whole row in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_row_stride, residual_row_stride, out_row_stride, residual_out_row_stride,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)  # the residual stream lives in the model dtype
        tl.store(residual_out_ptr + row * residual_out_row_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * weight).to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, hidden: int) -> None:
    if t.dim() != 2 or t.shape[1] != hidden or t.stride(1) != 1:
        raise ValueError(f"{name} must be (T, {hidden}) with contiguous rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = weight.shape[0]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is above the kernel's {MAX_HIDDEN}")
    _check_rows("x", x, hidden)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None
    if residual is not None:
        _check_rows("residual", residual, hidden)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual is {residual.dtype}, x is {x.dtype}: they must match")
        residual_out = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 8)
    r = residual if residual is not None else x  # unused when HAS_RESIDUAL is false
    r_out = residual_out if residual_out is not None else out
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0],)](
            x, r, weight, out, r_out,
            x.stride(0), r.stride(0), out.stride(0), r_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x (T, H) scaled by weight (H,), one launch; a new (T, H) tensor."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in one launch; both new (T, H) tensors.

    The sum is rounded to x's dtype before it is normalised, as the unfused model (and HF) adds the
    residual in the model dtype. Neither input is written: the new residual comes back as its own tensor.
    """
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch RMSNorm with the kernel's (and mixserve.model.ops.rms_norm's) numerics."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch (RMSNorm(x + residual) * weight, x + residual), the sum in x's dtype."""
    residual_out = x + residual
    return rms_norm_reference(residual_out, weight, eps), residual_out
