"""Rotary position embeddings on q and k, in place, in one Triton launch.

Eager PyTorch gathers cos/sin at the tokens' positions (2 kernels) and spends ~7 kernels per tensor on
rotate-half RoPE (two chunks, four products, a sum, a difference, a cat). Here one program per token reads
its position, loads the cos/sin row straight from the full tables, and rotates every q and k head of that
token in place. q and k may be strided views (strides (W, D, 1)) into the fused QKV projection's output,
so no copy is made; v, the rest of that buffer, is left alone.

Layout is Hugging Face's rotate-half: element i pairs with i + D/2 and the tables hold D/2 columns (the
first half; the second repeats it). Numerics follow `mixserve.model.rope.apply_rotary` in the model
dtype: each product is rounded to q's dtype before the sum/difference, which is rounded again (in float32
the casts are no-ops).

Positions are not range-checked (that would need a host sync): each must be below the tables' length.
Imports triton at module level: import this only after `mixserve.kernels.use_triton` said yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, head_stride, num_heads, half, cos, sin, dims, dims_mask,
                  BLOCK_HEADS: tl.constexpr):
    # Rotate heads 0 .. num_heads of one token in place; cos/sin are (BLOCK_HALF,) float32.
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads[:, None] < num_heads) & dims_mask[None, :]
    first = base_ptr + heads[:, None] * head_stride + dims[None, :]
    second = first + half
    dtype = base_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(second, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride,
    cos_row_stride, sin_row_stride, positions_stride,
    num_q_heads, num_kv_heads, half,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token * positions_stride).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dims_mask = dims < half
    cos = tl.load(cos_ptr + position * cos_row_stride + dims, mask=dims_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * sin_row_stride + dims, mask=dims_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, num_q_heads, half, cos, sin, dims,
                  dims_mask, BLOCK_Q_HEADS)
    _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, num_kv_heads, half, cos, sin, dims,
                  dims_mask, BLOCK_KV_HEADS)


def _check_heads(name: str, x: torch.Tensor, tokens: int, head_dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != tokens or x.shape[2] != head_dim or x.stride(2) != 1:
        raise ValueError(f"{name} must be (T={tokens}, heads, D={head_dim}) with contiguous heads, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by RoPE at `positions` (T,) int, one launch.

    cos/sin are the full (max_pos, D/2) tables of `RotaryTable`; row positions[t] rotates token t.
    """
    tokens, head_dim = q.shape[0], q.shape[-1]
    _check_heads("q", q, tokens, head_dim)
    _check_heads("k", k, tokens, head_dim)
    half = head_dim // 2
    if head_dim % 2 or cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be (max_pos, {half}) for head_dim {head_dim}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("cos/sin rows must be contiguous")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(f"positions must be ({tokens},), got {tuple(positions.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q is {q.dtype}, k is {k.dtype}: they must match")
    if tokens == 0:
        return
    _rotary_qk_kernel[(tokens,)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), positions.stride(0),
        q.shape[1], k.shape[1], half,
        BLOCK_Q_HEADS=triton.next_power_of_2(q.shape[1]),
        BLOCK_KV_HEADS=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """PyTorch rotate-half RoPE of (T, H, D) with (T, 1, D/2) cos/sin, as the unfused model does it."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch (rotated q, rotated k) as new tensors: cos/sin gathered at positions, then rotate-half."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return rotate_half_reference(q, c, s), rotate_half_reference(k, c, s)
